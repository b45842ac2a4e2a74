"""The Node.js client (tests/node, @grpc/grpc-js + @grpc/proto-loader) against a real worker."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import google.rpc
import pytest

from tests.support.processes import ROOT, ServiceProcess

NODE_DIR = ROOT / "tests" / "node"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is needed for the Node.js client test")
        pytest.skip(f"{name} not installed")
    return path


def test_node_client_generates_constrained_output(worker: ServiceProcess) -> None:
    node, npm = _tool("node"), _tool("npm")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600
        )
    # googleapis-common-protos ships google/rpc/*.proto next to its Python modules.
    googleapis = Path(next(iter(google.rpc.__path__))).parent.parent
    assert (googleapis / "google" / "rpc" / "status.proto").is_file()
    r = subprocess.run(
        [node, "--test", "generate.test.mjs"],
        cwd=NODE_DIR,
        env={
            **os.environ,
            "MASKWIRE_WORKER": worker.address,
            "MASKWIRE_GOOGLEAPIS_PROTOS": str(googleapis),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# pass 4" in r.stdout and "# skipped 0" in r.stdout, r.stdout
