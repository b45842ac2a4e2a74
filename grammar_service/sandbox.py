"""The compile sandbox: child processes that run the grammar compiler on untrusted grammars.

A grammar that overflows llguidance's native stack, aborts it, runs for minutes or eats memory
takes down a child process here, never the service with its live sessions. Each child loads the
service's tokenizers once, then verifies one grammar at a time (`compiler.verify`: validation, a
matcher, its first mask) on a thread with a large stack, under an address-space limit. The parent:

* kills a child whose job passes its deadline and starts a new one, so a runaway compile frees its
  worker at the deadline instead of holding it until it ends;
* reports a child that died mid-job as `SandboxCrashed` (the caller remembers the grammar as
  poison, see `grammar_service.poison`) and starts a new one;
* shares the children fairly: one client (a connection) and grammars over `large_bytes` may each
  hold at most `workers - 1` children, waiting jobs of the client with the fewest running jobs go
  first and small grammars before large ones; a job still waiting at its deadline is dropped
  without running.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing.connection
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from grammar_service import metrics
from grammar_service.compiler import arm_testing_faults, verify
from grammar_service.config import ParserLimits, SandboxConfig
from maskwire.rpc import RpcError

log = logging.getLogger(__name__)

# How long a new child may take to import and load its tokenizers before it counts as failed.
_START_TIMEOUT_S = 120.0
# Back-off between attempts to start a child that keeps failing to start.
_START_BACKOFF_S = (1.0, 30.0)


class SandboxCrashed(Exception):
    """The child died while compiling the grammar (signal or exit status in the message)."""


class SandboxUnavailable(Exception):
    """No child could be started (the message says why)."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the connection to it broke"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


# ------------------------------------------------------------------------------------- the child
def child_main(fd: int) -> None:
    """Entry point of a child (`python -m grammar_service.sandbox FD`): read its settings from
    the connection on FD, set its limits, serve jobs on a large-stack thread until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which stops us
    conn = multiprocessing.connection.Connection(fd)
    specs, limits, memory_mb, stack_mb, faults = conn.recv()
    arm_testing_faults(faults)
    if memory_mb > 0:
        cap = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    threading.stack_size(stack_mb << 20)
    worker = threading.Thread(target=_serve, args=(conn, specs, limits), name="compile")
    worker.start()
    worker.join()


def _serve(
    conn: multiprocessing.connection.Connection, specs: list[str], limits: ParserLimits
) -> None:
    from maskwire.tokenizer import load_tokenizer

    try:
        tokenizers = [load_tokenizer(s) for s in specs]
    except Exception as e:
        conn.send(("failed", f"cannot load tokenizers {specs}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            grammar, index, field = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        try:
            checked = verify(grammar, tokenizers[index], limits, field)
            conn.send(("ok", checked.warnings))
        except RpcError as e:
            conn.send(("invalid", e.code.name, e.message, e.violations, e.reason))
        except MemoryError:
            conn.send(("invalid", "INVALID_ARGUMENT", "compiling needs too much memory", (), ""))
        except Exception as e:  # a library failure, reported as a bad grammar, never a trace
            conn.send(("invalid", "INVALID_ARGUMENT", f"cannot compile: {e}", (), ""))


# ------------------------------------------------------------------------------------ the parent
class _Child:
    """One child process and its connection. Blocking methods; they run on the sandbox's threads."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.jobs = 0

    def start(self, specs: list[str], limits: ParserLimits, config: SandboxConfig) -> None:
        """Start a fresh child and wait until it has loaded its tokenizers (raises on failure).
        A plain `python -m` child: nothing of this process (threads, its __main__) is copied."""
        ours, theirs = socket.socketpair()
        with ours, theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "grammar_service.sandbox", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
            conn = multiprocessing.connection.Connection(os.dup(ours.fileno()))
        try:
            conn.send((specs, limits, config.memory_mb, config.stack_mb, config.testing_faults))
            if not conn.poll(_START_TIMEOUT_S):
                raise SandboxUnavailable(f"compile worker did not start in {_START_TIMEOUT_S:g}s")
            kind, detail = conn.recv()
            if kind != "ready":
                raise SandboxUnavailable(str(detail))
        except (EOFError, OSError):
            conn.close()
            proc.kill()
            raise SandboxUnavailable(
                f"compile worker {_describe_exit(proc.wait())} while starting"
            ) from None
        except SandboxUnavailable:
            conn.close()
            proc.kill()
            proc.wait()
            raise
        self.proc, self.conn, self.jobs = proc, conn, 0

    def run(self, grammar: str, index: int, field: str, timeout_s: float) -> tuple[Any, ...]:
        """Verify one grammar. Returns the child's answer, or ("crashed", why) / ("timeout",)
        after which this child is gone."""
        proc, conn = self.proc, self.conn
        assert proc is not None and conn is not None
        self.jobs += 1
        try:
            conn.send((grammar, index, field))
            if conn.poll(max(timeout_s, 0.0)):
                return tuple(conn.recv())
        except (EOFError, OSError):
            try:
                code: int | None = proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            self.stop()
            return ("crashed", _describe_exit(code))
        self.stop()
        return ("timeout",)

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.conn is not None


@dataclass(eq=False)
class _Waiter:
    """A job waiting for (then holding) a child."""

    large: bool
    client: str
    seq: int
    future: asyncio.Future[_Child]


class Sandbox:
    """A pool of compile children with deadlines, crash detection and two lanes."""

    def __init__(
        self,
        specs: Sequence[str],
        limits: ParserLimits,
        config: SandboxConfig = SandboxConfig(),  # noqa: B008 (frozen, immutable)
    ) -> None:
        if not specs or any(not s for s in specs):
            raise ValueError("the sandbox needs a tokenizer SPEC for every served tokenizer")
        self.specs = list(specs)
        self.limits = limits
        self.config = config
        self.workers = max(1, config.workers)
        # Threads: one per running job plus one per child (re)starting.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * self.workers, thread_name_prefix="sandbox"
        )
        self._children = [_Child(slot) for slot in range(self.workers)]
        self._idle: list[_Child] = []
        self._waiters: list[_Waiter] = []
        self._running_large = 0
        self._running: collections.Counter[str] = collections.Counter()  # jobs per client
        self._seq = itertools.count()
        self._ready = 0
        self._last_start_error = ""
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start every child in the background (jobs wait until one is ready); once."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        for child in self._children:
            self._restart(child)

    def close(self) -> None:
        """Stop every child (jobs still running end as SandboxUnavailable)."""
        self._closed = True
        for child in self._children:
            child.stop()
        self._idle.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

    @property
    def ready_workers(self) -> int:
        return self._ready

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until a child can take a job; SandboxUnavailable after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._ready == 0:
            if time.monotonic() >= deadline:
                raise SandboxUnavailable(
                    self._last_start_error or f"no compile worker started in {timeout_s:g}s"
                )
            await asyncio.sleep(0.05)

    def _restart(self, child: _Child, attempt: int = 0) -> None:
        """Start `child`'s process on a thread; it joins the idle list when ready."""
        assert self._loop is not None
        loop = self._loop

        def run() -> None:
            if attempt:
                time.sleep(min(_START_BACKOFF_S[0] * 2 ** (attempt - 1), _START_BACKOFF_S[1]))
            if self._closed:
                return
            try:
                child.start(self.specs, self.limits, self.config)
            except Exception as e:
                if self._closed:  # the service stopped while this child started
                    return
                log.error("compile worker %d failed to start: %s", child.slot, e)
                loop.call_soon_threadsafe(self._start_failed, child, attempt, str(e))
                return
            loop.call_soon_threadsafe(self._started, child)

        self._threads.submit(run)

    def _started(self, child: _Child) -> None:
        if self._closed:
            child.stop()
            return
        self._ready += 1
        metrics.SANDBOX_WORKERS.set(self._ready)
        self._idle.append(child)
        self._dispatch()

    def _start_failed(self, child: _Child, attempt: int, error: str) -> None:
        self._last_start_error = error
        if not self._closed:
            self._restart(child, attempt + 1)

    # ------------------------------------------------------------------ scheduling
    def _may_take(self, w: _Waiter) -> bool:
        """Large grammars, and any one client, may hold at most all children but one."""
        if self.workers == 1:
            return True
        share = self.workers - 1
        return self._running[w.client] < share and (not w.large or self._running_large < share)

    def _dispatch(self) -> None:
        """Give idle children to waiting jobs: the client with the fewest running jobs first,
        then small grammars before large ones, then in arrival order."""
        self._waiters = [w for w in self._waiters if not w.future.done()]
        while self._idle:
            eligible = [w for w in self._waiters if self._may_take(w)]
            if not eligible:
                return
            chosen = min(eligible, key=lambda w: (self._running[w.client], w.large, w.seq))
            self._waiters.remove(chosen)
            self._running_large += chosen.large
            self._running[chosen.client] += 1
            chosen.future.set_result(self._idle.pop())

    async def _acquire(self, w: _Waiter, deadline: float) -> _Child:
        self._waiters.append(w)
        self._dispatch()
        fut = w.future
        if fut.done():
            return fut.result()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), deadline - time.monotonic())
        except (TimeoutError, asyncio.CancelledError):
            if fut.done() and not fut.cancelled():
                self._release(fut.result(), w)  # handed over just as we gave up
            else:
                fut.cancel()
            raise

    def _release(self, child: _Child, w: _Waiter) -> None:
        self._running_large -= w.large
        self._running[w.client] -= 1
        if not self._running[w.client]:
            del self._running[w.client]
        if self._closed:
            child.stop()
        elif child.alive:
            self._idle.append(child)
        else:
            self._ready -= 1
            metrics.SANDBOX_WORKERS.set(self._ready)
            if not self._closed:
                self._restart(child)
        if not self._closed:
            self._dispatch()

    # ------------------------------------------------------------------ jobs
    async def verify(
        self,
        grammar: str,
        tokenizer_index: int,
        field: str,
        *,
        deadline: float,
        client: str = "",
    ) -> tuple[str, ...]:
        """Verify `grammar` in a child before `deadline` (time.monotonic()). Returns its
        warnings. `client` names who asked (a connection): one client never holds every child.
        Raises RpcError (the grammar is invalid), SandboxCrashed, TimeoutError,
        SandboxUnavailable (no child could be started)."""
        if self._closed:
            raise SandboxUnavailable("the grammar service is shutting down")
        w = _Waiter(
            large=len(grammar) > self.config.large_bytes,
            client=client,
            seq=next(self._seq),
            future=asyncio.get_running_loop().create_future(),
        )
        try:
            child = await self._acquire(w, deadline)
        except TimeoutError:
            if self._ready == 0 and self._last_start_error:
                raise SandboxUnavailable(self._last_start_error) from None
            raise
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(
            self._threads, child.run, grammar, tokenizer_index, field, deadline - time.monotonic()
        )
        # The child goes back to the pool when its job ends, even if our caller gave up.
        job.add_done_callback(lambda _: self._release(child, w))
        answer = await asyncio.shield(job)
        if self._closed:
            raise SandboxUnavailable("the grammar service is shutting down")
        kind = answer[0]
        if kind == "ok":
            return tuple(answer[1])
        if kind == "invalid":
            _, code, message, violations, reason = answer
            raise RpcError(grpc.StatusCode[code], message, violations, reason)
        if kind == "crashed":
            metrics.SANDBOX_CRASHES.inc()
            raise SandboxCrashed(answer[1])
        metrics.SANDBOX_KILLS.inc()
        raise TimeoutError


if __name__ == "__main__":
    child_main(int(sys.argv[1]))
