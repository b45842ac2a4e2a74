"""deploy/docker: compose.yaml is valid Compose, the Dockerfiles copy what exists and run real commands."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from maskwire.discovery import parse_target

from .manifests import DOCKER, ROOT, parse_service_args

SERVICES = {"grammar": "grammar-service", "worker": "worker", "gateway": "gateway"}
COMPOSE_SCHEMA = Path(__file__).with_name("compose-spec.json")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_matches_the_compose_spec(compose: dict[str, Any]) -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_schema_catches_mistakes(compose: dict[str, Any]) -> None:
    # Guard against a schema that accepts anything.
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["depends_on"]["grammar"]["condition"] = "service_ready"
    broken["services"]["gateway"]["portz"] = ["8000:8000"]
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    assert len(list(validator.iter_errors(broken))) >= 2


def test_compose_services_build_and_run_real_commands(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == set(SERVICES)
    for name, command in SERVICES.items():
        svc = services[name]
        assert (ROOT / svc["build"]["context"].replace("../..", ".")).resolve() == ROOT
        assert (DOCKER.parent.parent / svc["build"]["dockerfile"]).is_file()
        args = parse_service_args(svc["command"])
        assert args.command == command and args.host == "0.0.0.0"
        for dep in svc.get("depends_on", {}):
            assert dep in services
    worker = parse_service_args(services["worker"]["command"])
    grammar = parse_service_args(services["grammar"]["command"])
    target = parse_target(worker.grammar_service)
    assert target.resolve and target.host == "grammar" and target.port == grammar.port
    gateway = parse_service_args(services["gateway"]["command"])
    assert gateway.worker == [f"worker:{worker.port}"]


def test_compose_health_checks_and_compile_cache(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for svc in services.values():
        # A shell line (CMD-SHELL): podman-compose 1.0.3 breaks the list forms.
        assert isinstance(svc["healthcheck"]["test"], str)
        assert svc["read_only"] and svc["cap_drop"] == ["ALL"] and "/tmp" in svc["tmpfs"]
    # The worker's compile cache on a named volume, at the directory its image gives uid 10001.
    worker = services["worker"]
    assert worker["environment"]["XDG_CACHE_HOME"] == "/var/cache/maskwire"
    assert "compile-cache:/var/cache/maskwire" in worker["volumes"]
    assert "compile-cache" in compose["volumes"]
    assert "install -d -o 10001 -g 10001 /var/cache/maskwire" in re.sub(
        r"\s+", " ", (DOCKER / "Dockerfile.worker").read_text()
    )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dockerfile(name: str) -> None:
    path = DOCKER / f"Dockerfile.{name}"
    steps = instructions(path)
    # Two stages on one base: the build stage installs into /opt/maskwire, the final stage copies
    # only that environment.
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    froms = [a for i, a in steps if i == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    final = steps[max(n for n, (i, _) in enumerate(steps) if i == "FROM") :]
    assert ("COPY", "--from=build /opt/maskwire /opt/maskwire") in final
    # Every COPY source exists in the build context (the repository root) and is not ignored.
    ignore = (DOCKER / f"Dockerfile.{name}.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    for instr, rest in steps:
        if instr == "COPY" and not rest.startswith("--from="):
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
                assert src in allowed, f"{path.name}: COPY {src} is excluded by its .dockerignore"
    runs = " ".join(a for i, a in steps if i == "RUN")
    if name == "worker":
        # torch pinned to the CPU wheel (local version +cpu), from the CPU index by default; a
        # compiler in the final stage for inductor and the worker's kernels.
        assert "torch==${TORCH_VERSION}+cpu" in runs
        assert re.search(r"ARG TORCH_INDEX_URL=\S+/whl/cpu\n", path.read_text())
        assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", path.read_text())
        assert "g++" in " ".join(a for i, a in final if i == "RUN")
    else:
        # The grammar service and the gateway never import torch; no compiler either.
        assert "--without torch" in runs and "torch==" not in runs
        assert "apt-get" not in runs
    # Runs as a non-root numeric user (Kubernetes runAsNonRoot checks the number).
    users = [a for i, a in steps if i == "USER"]
    assert users and users[-1].isdigit() and users[-1] != "0"
    # ENTRYPOINT + CMD is a real maskwire subcommand, listening on the port it EXPOSEs.
    entry = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in steps if i == "CMD"))
    assert entry == ["maskwire"]
    args = parse_service_args(cmd)
    assert args.command == SERVICES[name] and args.host == "0.0.0.0"
    exposed = " ".join(a for i, a in steps if i == "EXPOSE").split()
    assert str(args.port) in exposed
    assert any(i == "HEALTHCHECK" and str(args.port) in a for i, a in steps)


def test_images_named_alike_in_compose_and_kubernetes(compose: dict[str, Any]) -> None:
    base = yaml.safe_load((ROOT / "deploy/k8s/base/kustomization.yaml").read_text())
    tags = {i["name"]: i["newTag"] for i in base["images"]}
    for name, svc in compose["services"].items():
        image, tag = svc["image"].split(":")
        assert tags[image] == tag == f"{_version()}"
        assert image == f"maskwire-{name}"


def _version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
