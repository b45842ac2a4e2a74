"""`maskwire up --grammar-replicas 2` with the real services: the default ports work, and a replica
SIGKILLed under load is restarted by `up` and used again by the worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from maskwire.demo import run_demo
from maskwire.up import port_free
from maskwire.v1 import worker_pb2_grpc
from tests.integration.faults.support import assert_valid, start_constrained
from tests.integration.worker.conftest import Result, channel
from tests.support.metrics import metric
from tests.support.processes import ROOT

STARTUP_S = 300.0  # four services loading on two busy cores
DEFAULT_PORTS = (8000, 50052, 50061, 50062)  # gateway, worker, two grammar replicas


class Up:
    """A `maskwire up` process; its banner (stdout) and supervisor log (stderr) go to files."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.out = tmp_path / "up.out"
        self.err = tmp_path / "up.err"
        self.logs = tmp_path / "logs"
        argv = ["up", "--no-show-logs", "--log-dir", str(self.logs), "--grammar-replicas", "2"]
        # The supervisor is under test, not the forward: the worker's reference settings start
        # in seconds (the compiled default is tested by test_up_demo and the compiled suite).
        argv += ["--worker-arg=--no-compile", "--worker-arg=--dtype=float32"]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "maskwire.cli", *argv, *args],
                stdout=out,
                stderr=err,
                cwd=ROOT,
            )

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, needle: str, timeout_s: float) -> str:
        """Everything `up` printed once `needle` appears; fails when `up` exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.text()
            if needle in text:
                return text
            if self.proc.poll() is not None:
                raise AssertionError(f"up exited ({self.proc.returncode}):\n{text}")
            time.sleep(0.2)
        raise AssertionError(f"{needle!r} not printed in {timeout_s:g}s:\n{self.text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


@contextlib.contextmanager
def running_up(tmp_path: Path, *args: str) -> Iterator[Up]:
    """`maskwire up --grammar-replicas 2 ARGS`, stopped with SIGTERM afterwards (must exit 0)."""
    up = Up(tmp_path, *args)
    try:
        yield up
    except BaseException:
        up.stop()
        raise
    assert up.stop() == 0, up.text()


def test_two_replicas_on_the_default_ports_serve_a_constrained_request(tmp_path: Path) -> None:
    busy = [p for p in DEFAULT_PORTS if not port_free("127.0.0.1", p)]
    if busy:
        pytest.skip(f"default ports in use here: {busy}")
    with running_up(tmp_path) as up:
        try:
            banner = up.wait_for("Press Ctrl-C to stop.", STARTUP_S)
        except AssertionError:
            if "is already in use" in up.text():  # taken since the check above
                pytest.skip("a default port was taken meanwhile")
            raise
        assert "grammar service (gRPC)  127.0.0.1:50061, 127.0.0.1:50062" in banner
        assert run_demo("http://127.0.0.1:8000") == 0  # a JSON-schema request, answer validated


FREE_PORTS = ("--port", "0", "--worker-port", "0", "--grammar-port", "0")


@pytest.mark.slow  # ~35 s on 2 cores; .ci/run's slow stage runs it
async def test_replica_killed_under_load_is_restarted_and_used_again(tmp_path: Path) -> None:
    with running_up(tmp_path, *FREE_PORTS, "--metrics", "--worker-arg=--max-seq-len=512") as up:
        await _kill_a_replica_under_load(up)


LIVE = "maskwire_grammar_live_requests"


async def _all_opened(tasks: list[asyncio.Task[Result]], metrics: dict[str, str]) -> None:
    """Wait until the replicas hold every request (prefill of 16 prompts takes a while)."""
    deadline = time.monotonic() + 120
    while sum(metric(url, LIVE) for url in metrics.values()) < len(tasks):
        assert time.monotonic() < deadline, "the requests were never all opened"
        await asyncio.sleep(0.1)
    assert not any(t.done() for t in tasks), "requests finished before the fault"


async def _kill_a_replica_under_load(stack: Up) -> None:
    banner = stack.wait_for("Press Ctrl-C to stop.", STARTUP_S)
    worker = re.search(r"worker \(gRPC\) +(\S+)", banner)
    assert worker is not None, banner
    pids = dict(re.findall(r"started (grammar-\d) on \S+ \(pid (\d+)\)", banner))
    metrics = {
        name: url for url, name in re.findall(r"(http://\S+/metrics) \((grammar-\d)\)", banner)
    }

    async with channel(worker.group(1)) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = start_constrained(stub, 16)
        await _all_opened(tasks, metrics)
        victim = max(metrics, key=lambda name: metric(metrics[name], LIVE))
        os.kill(int(pids[victim]), signal.SIGKILL)
        for r in await asyncio.gather(*tasks):
            assert_valid(r)  # the victim's requests were replayed on the other replica
        assert "re-opened" in (stack.logs / "worker.log").read_text()

        log = stack.wait_for(f"{victim} is healthy again (restart 1)", 120)
        assert f"{victim} (pid {pids[victim]}) died: signal SIGKILL" in log
        # New requests spread over both replicas again: the restarted one gets its share.
        for r in await asyncio.gather(*start_constrained(stub, 4)):
            assert_valid(r)
    # The restarted process (its metrics start from zero) has the worker's stream and served steps.
    assert metric(metrics[victim], "maskwire_grammar_live_sessions") == 1
    assert metric(metrics[victim], "maskwire_grammar_step_seconds_count") > 0
