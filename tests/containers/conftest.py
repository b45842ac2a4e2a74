"""The container suite's stack: deploy/docker/compose.yaml under podman-compose on the images of
deploy/images.sh, one project per run (its own network and compile-cache volume, so the worker's
first start compiles from nothing). `make test-containers` prepares the machine; where containers
cannot run, every test fails with the reason."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.containers.compose import ComposeStack, engine_problem, podman
from tests.support.processes import free_port

# Measured start times, printed at the end of the run (docs/operations.md quotes them).
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    problem = engine_problem()
    if problem is not None:
        pytest.fail(f"this machine cannot run the container suite: {problem}", pytrace=False)
    logs = tmp_path_factory.mktemp("compose-logs")
    s = ComposeStack(f"maskwire-ct-{os.getpid()}", free_port(), free_port(), logs)
    began = time.monotonic()
    try:
        s.compose("up", "-d", "--no-build")
        for name in s.containers("grammar"):
            s.wait_healthy(name, timeout_s=180)
        [worker] = s.containers("worker")
        s.wait_healthy(worker, timeout_s=900, ready=s.worker_ready)
        TIMINGS["worker start, cold compile cache (up -> healthy)"] = time.monotonic() - began
        [gateway] = s.containers("gateway")
        s.wait_healthy(gateway, timeout_s=120, ready=s.gateway_ready)
        yield s
    finally:
        s.save_logs()
        print(f"\ncontainer logs: {logs}")
        s.compose("down", "-v", "-t", "5")
        podman("network", "rm", "-f", f"{s.project}_default", check=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.section("container timings")
        for what, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{what}: {seconds:.1f} s")
