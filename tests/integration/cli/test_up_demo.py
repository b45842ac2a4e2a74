"""`maskwire up --demo` (the README's first command) end to end with the real services."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maskwire.demo import SCHEMA, schema_errors
from tests.support.processes import ROOT


# The demo runs the worker's default, compiled configuration: from a cold compile cache the
# worker compiles its graphs first (~4-6 minutes on a loaded 2-core host).
@pytest.mark.timeout(1500)
def test_up_demo_prints_a_valid_answer_and_stops_everything(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "maskwire.cli", "up", "--demo", "--log-dir", str(tmp_path)],
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
