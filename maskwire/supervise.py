"""Run a few maskwire services as child processes: start, probe health, relay logs, stop in order.

Used by `maskwire up`. Each child is `python -m maskwire.cli <command> --port P ...` in its own
process group (so a terminal Ctrl-C reaches only the supervisor, which then stops the children in
the order it chooses), told in its environment to take a parent-death signal on Linux so children
never outlive a killed supervisor (`maskwire.lifeline`). Output goes line by line to a log file and, optionally, to stderr with a name prefix.
A child can be started again after it died (same command line, its log appended to); a
`RestartPolicy` says how long to wait first and when to give up.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.lifeline import supervised_env
from maskwire.signal_flag import StopFlag

TAIL_LINES = 40


class ChildExited(RuntimeError):
    """A child process ended while it was expected to run."""

    def __init__(self, child: Child, why: str = "") -> None:
        self.child = child
        self.why = why  # what the supervisor concluded, for the message after the death report
        super().__init__(f"{child.name} exited with {child.describe_exit()}")


class RestartPolicy:
    """Restart a dead child after a growing delay; give up when it keeps dying.

    The delay starts at `backoff_s[0]` and doubles per death still inside the `window_s`
    (capped at `backoff_s[1]`); the `limit`-th death inside the window means give up. This is
    what a Kubernetes Deployment does for a crashing pod, minus the endless CrashLoopBackOff:
    a local stack whose replica cannot stay up should stop and say so.
    """

    def __init__(self, *, limit: int, window_s: float, backoff_s: tuple[float, float]) -> None:
        self.limit = limit
        self.window_s = window_s
        self.backoff_s = backoff_s
        self._deaths: collections.deque[float] = collections.deque()

    def on_death(self, now: float) -> float | None:
        """Record a death at `now` (monotonic seconds); the delay before restarting, or None."""
        self._deaths.append(now)
        while self._deaths and self._deaths[0] <= now - self.window_s:
            self._deaths.popleft()
        recent = len(self._deaths)
        if recent >= self.limit:
            return None
        return float(min(self.backoff_s[0] * 2 ** (recent - 1), self.backoff_s[1]))

    def describe(self) -> str:
        """When it gives up, for messages: `5 times in 60s`."""
        return f"{self.limit} times in {self.window_s:g}s"


def grpc_healthy(address: str, timeout_s: float = 2.0) -> bool:
    """True when the gRPC server at `address` reports SERVING for the overall health check."""
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def http_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


class Child:
    """One supervised `maskwire` subcommand."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        probe: Callable[[], bool],
        echo: IO[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.probe = probe
        self.echo = echo
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **supervised_env(), **(env or {})}
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.killed = False
        self.restarts = 0  # starts after the first
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        """Start the process; after the first time, a restart: same command, log appended to."""
        if self.proc is not None:
            if self._reader is not None:
                self._reader.join(timeout=2)  # the old output is in the log before the new
            self.restarts += 1
            self.tail.clear()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            process_group=0,
        )
        self._reader = threading.Thread(
            target=self._relay, args=(self.proc,), name=f"log-{self.name}", daemon=True
        )
        self._reader.start()

    def _relay(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefix = f"[{self.name}] "
        with self.log_path.open("a" if self.restarts else "w", encoding="utf-8") as log:
            if self.restarts:
                log.write(f"----- restart {self.restarts} -----\n")
            for raw in proc.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self.tail.append(line)
                log.write(line + "\n")
                log.flush()
                if self.echo is not None:
                    try:
                        self.echo.write(prefix + line + "\n")
                        self.echo.flush()
                    except (OSError, ValueError):
                        pass

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe_exit(self) -> str:
        code = self.poll()
        if code is None:
            return "no exit (still running)"
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def last_lines(self, n: int = 20) -> list[str]:
        """The child's last output lines (waits briefly for the relay to drain after exit)."""
        if self._reader is not None and not self.running:
            self._reader.join(timeout=2)
        return list(self.tail)[-n:]

    def wait_ready(
        self, timeout_s: float, should_abort: Callable[[], bool] = lambda: False
    ) -> bool:
        """Poll the health probe until it passes (True), or `should_abort()` (False).

        Raises `ChildExited` if the process ends and `TimeoutError` after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if should_abort():
                return False
            if not self.running:
                raise ChildExited(self)
            if self.probe():
                return True
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} was not healthy after {timeout_s:g}s")

    def terminate(self) -> None:
        if self.running:
            self.stopping = True
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running:
            self.stopping = True
            self.killed = True
            assert self.proc is not None
            self.proc.kill()

    def wait(self, timeout_s: float) -> bool:
        """Wait for exit; True if it exited in time."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        if self._reader is not None:
            self._reader.join(timeout=2)
        return True


def stop_in_order(
    tiers: Sequence[Sequence[Child]],
    grace_s: float,
    *,
    force: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = lambda _: None,
) -> None:
    """SIGTERM each tier (its children together), wait up to `grace_s`, then SIGKILL what is left.

    Tiers go in the order given (gateway, worker, grammar replicas). `force()` returning True
    (a second Ctrl-C) skips the grace period.
    """
    for tier in tiers:
        live = [c for c in tier if c.running]
        if not live:
            continue
        for c in live:
            c.terminate()
        deadline = time.monotonic() + grace_s
        while any(c.running for c in live) and time.monotonic() < deadline and not force():
            time.sleep(0.1)
        for c in live:
            if c.running:
                say(f"{c.name} did not stop within {grace_s:g}s: killing it")
                c.kill()
            c.wait(5)


def watch(
    children: Sequence[Child],
    stop: StopFlag,
    *,
    policies: Mapping[Child, RestartPolicy],
    on_death: Callable[[Child], None],
    say: Callable[[str], None] = lambda _: None,
    interval_s: float = 0.2,
) -> None:
    """Block until `stop` is set, keeping the children alive.

    A child with a policy that dies is reported (`on_death`) and started again after the policy's
    delay; `say` tells when it is back and healthy. Raises `ChildExited` for a death without a
    policy, or when the policy gives up (`why` says so).
    """
    restart_at: dict[Child, float] = {}
    recovering: set[Child] = set()  # restarted, not healthy yet
    while not stop.wait(interval_s):
        now = time.monotonic()
        for c in children:
            if c in restart_at:
                if now >= restart_at[c]:
                    del restart_at[c]
                    c.start()
                    recovering.add(c)
                    say(f"restarted {c.name} (pid {c.pid}, restart {c.restarts})")
            elif c.running:
                if c in recovering and c.probe():
                    recovering.discard(c)
                    say(f"{c.name} is healthy again (restart {c.restarts})")
            else:
                policy = policies.get(c)
                if policy is None:
                    raise ChildExited(c)
                delay = policy.on_death(now)
                if delay is None:
                    raise ChildExited(c, f"{c.name} died {policy.describe()}: giving up")
                on_death(c)
                recovering.discard(c)
                restart_at[c] = now + delay
                say(
                    f"restarting {c.name} in {delay:g}s (restart {c.restarts + 1}; "
                    f"giving up if it dies {policy.describe()})"
                )
