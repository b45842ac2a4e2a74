"""`maskwire up --demo` (the README's first command) end to end with the real services."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maskwire.demo import SCHEMA, schema_errors
from tests.support.processes import ROOT


# The README's command runs the worker's default, compiled configuration: from a cold compile
# cache (a fresh machine) the worker compiles its graphs first (~4-6 minutes on a loaded 2-core
# host), so that case is in the slow suite. The default run starts the same command with the
# worker's reference settings (eager float32, in seconds): the same supervisor, demo request,
# answer check and shutdown.
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "worker_args",
    [
        pytest.param((), id="compiled-default", marks=pytest.mark.slow),
        pytest.param(("--worker-arg=--no-compile", "--worker-arg=--dtype=float32"), id="reference"),
    ],
)
def test_up_demo_prints_a_valid_answer_and_stops_everything(
    tmp_path, worker_args: tuple[str, ...]
) -> None:
    argv = ["up", "--demo", "--log-dir", str(tmp_path), *worker_args]
    r = subprocess.run(
        [sys.executable, "-m", "maskwire.cli", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    answer = next(line for line in r.stdout.splitlines() if line.startswith("  answer  "))
    value = json.loads(answer.removeprefix("  answer  "))
    assert schema_errors(value, SCHEMA) == []
    assert "valid   yes" in r.stdout
    assert r.stderr.rstrip().endswith("maskwire up: stopped")
    # Each service logged to the printed directory and shut down on SIGTERM.
    assert {p.name for p in tmp_path.iterdir()} == {"grammar.log", "worker.log", "gateway.log"}
