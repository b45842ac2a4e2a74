"""Helpers for the deploy tests: render kustomize overlays, check service args with the real CLI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from maskwire.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def kubectl() -> str:
    """Path of kubectl; a test without it is skipped locally but fails in CI."""
    path = shutil.which("kubectl")
    if path is None:
        message = "kubectl (with its built-in kustomize) is needed to render deploy/k8s overlays"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s/overlays/<overlay>` as a list of objects."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def expand_env(arg: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion in container args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


def parse_service_args(argv: list[str]) -> Any:
    """Parse `maskwire <argv>` with the real CLI parser; a bad flag fails the test."""
    parser = build_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`maskwire {' '.join(argv)}` is not accepted by the maskwire CLI")
