"""`maskwire up --grammar-replicas 2` with the real services: the default ports work."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from maskwire.demo import run_demo
from maskwire.up import port_free
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
