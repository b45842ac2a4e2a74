"""The compile sandbox with real child processes: verdicts, crashes, deadlines, its two lanes,
the memory cap, and children that fail to start.

Crashes and hangs come from the test-only fault hook, which the sandbox arms in its children with
the specs of `SandboxConfig.testing_faults` (the service's `--testing-faults`).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import llguidance
import pytest

from grammar_service import metrics
from grammar_service import sandbox as sandbox_module
from grammar_service.config import ParserLimits, SandboxConfig
from grammar_service.sandbox import Sandbox, SandboxCrashed, SandboxUnavailable
from maskwire.rpc import RpcError

# The sandbox calls back into the loop that started it: fixtures and tests share one loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")

CRASH = "sandbox-test-abort"
HANG = "sandbox-test-hang"
FIELD = "constraint.lark"


def lark(text: str) -> str:
    return str(llguidance.LLMatcher.grammar_from_lark(text))


def ok_grammar(tag: str = "x") -> str:
    return lark(f'start: "{tag}" /[0-9]+/')


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    config = SandboxConfig(workers=2, large_bytes=4096, testing_faults=f"sandbox:abort:{CRASH}")
    box = Sandbox(["default"], ParserLimits(), config)
    box.start()
    # Both children up (each loads the tokenizer once).
    await box.verify(ok_grammar(), 0, FIELD, deadline=time.monotonic() + 120)
    while box.ready_workers < 2:
        await asyncio.sleep(0.05)
    try:
        yield box
    finally:
        box.close()


def deadline(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


async def test_verdicts_come_back_from_the_child(sandbox: Sandbox) -> None:
    assert await sandbox.verify(ok_grammar(), 0, FIELD, deadline=deadline()) == ()
    with pytest.raises(RpcError) as info:
        await sandbox.verify(lark("start: undefined_rule"), 0, FIELD, deadline=deadline())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == FIELD
    assert "undefined_rule" in info.value.message


async def test_a_crash_kills_a_child_which_is_replaced(sandbox: Sandbox) -> None:
    crashes = metrics.SANDBOX_CRASHES._value.get()
    with pytest.raises(SandboxCrashed, match="SIGABRT"):
        await sandbox.verify(lark(f'start: "{CRASH}"'), 0, FIELD, deadline=deadline())
    assert metrics.SANDBOX_CRASHES._value.get() == crashes + 1
    # The other child answers at once; the replacement joins within its start-up time.
    assert await sandbox.verify(ok_grammar(), 0, FIELD, deadline=deadline(5)) == ()
    t0 = time.monotonic()
    while sandbox.ready_workers < 2:
        assert time.monotonic() - t0 < 60, "the crashed child was not replaced"
        await asyncio.sleep(0.05)


async def test_a_runaway_compile_is_killed_at_its_deadline(sandbox: Sandbox) -> None:
    # A sandbox whose children hang on HANG (the fixture's children abort on CRASH instead).
    box = Sandbox(
        ["default"], ParserLimits(), SandboxConfig(workers=2, testing_faults=f"sandbox:hang:{HANG}")
    )
    box.start()
    try:
        await box.verify(ok_grammar(), 0, FIELD, deadline=deadline(120))
        kills = metrics.SANDBOX_KILLS._value.get()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await box.verify(lark(f'start: "{HANG}"'), 0, FIELD, deadline=deadline(0.5))
        assert time.monotonic() - t0 < 5
        assert metrics.SANDBOX_KILLS._value.get() == kills + 1
        assert await box.verify(ok_grammar(), 0, FIELD, deadline=deadline(60)) == ()
    finally:
        box.close()


@pytest.fixture
async def hanging() -> AsyncIterator[Sandbox]:
    """Two children that hang on HANG; grammars over 1 KiB are large."""
    config = SandboxConfig(workers=2, large_bytes=1024, testing_faults=f"sandbox:hang:{HANG}")
    box = Sandbox(["default"], ParserLimits(), config)
    box.start()
    await box.verify(ok_grammar(), 0, FIELD, deadline=deadline(120))
    while box.ready_workers < 2:
        await asyncio.sleep(0.05)
    try:
        yield box
    finally:
        box.close()


async def _hogs_leave_room(box: Sandbox, hog: str, clients: tuple[str, str]) -> None:
    hogs = [
        asyncio.create_task(box.verify(hog, 0, FIELD, deadline=deadline(3), client=c))
        for c in clients
    ]
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    assert await box.verify(ok_grammar("small"), 0, FIELD, deadline=deadline(2), client="me") == ()
    assert time.monotonic() - t0 < 1.5
    for task in hogs:
        with pytest.raises(TimeoutError):
            await task  # one killed at its deadline, the other dropped there without running


async def test_small_grammars_do_not_queue_behind_large_ones(hanging: Sandbox) -> None:
    big = lark(f'start: "{HANG}" ' + " ".join(f'"w{i}"' for i in range(400)))
    assert len(big) > 1024
    await _hogs_leave_room(hanging, big, ("a", "b"))


async def test_one_client_never_holds_every_child(hanging: Sandbox) -> None:
    await _hogs_leave_room(hanging, lark(f'start: "{HANG}"'), ("a", "a"))


# ------------------------------------------------------------------ memory cap, start failures
HOG = "allocate-two-gibibytes"
# Loaded by every Python process started with its directory first on PYTHONPATH (the sandbox's
# children in the test below): `verify` asks for 2 GiB (not touched, so cheap where allowed)
# for a grammar that holds HOG.
HOG_SITECUSTOMIZE = f"""
import grammar_service.compiler as compiler

_verify = compiler.verify


def verify(grammar, *args, **kwargs):
    if {HOG!r} in grammar:
        bytearray(2 << 30)
    return _verify(grammar, *args, **kwargs)


compiler.verify = verify
"""


def address_space_limit(pid: int) -> str:
    """The soft and hard address-space limits of process `pid` (/proc/PID/limits)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            return " ".join(line.split()[3:5])
    raise AssertionError("no address-space line")


def child_pids(box: Sandbox) -> list[int]:
    return [c.proc.pid for c in box._children if c.proc is not None]


async def started(box: Sandbox, workers: int) -> None:
    box.start()
    await box.wait_ready(120)
    t0 = time.monotonic()
    while box.ready_workers < workers:
        assert time.monotonic() - t0 < 120, "the children did not start"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("memory_mb", [0, 1536])
async def test_a_compile_past_the_memory_cap_is_refused_and_the_child_serves_on(
    memory_mb: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each child runs under `--compile-memory-mb` (0: no cap). A compile that asks for more
    gets a MemoryError, answered as a bad grammar; the child stays and takes the next job."""
    (tmp_path / "sitecustomize.py").write_text(HOG_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    box = Sandbox(["default"], ParserLimits(), SandboxConfig(workers=1, memory_mb=memory_mb))
    try:
        await started(box, 1)
        (pid,) = child_pids(box)
        cap = f"{memory_mb << 20} {memory_mb << 20}" if memory_mb else "unlimited unlimited"
        assert address_space_limit(pid) == cap
        hog = lark(f'start: "{HOG}"')
        if memory_mb:
            with pytest.raises(RpcError) as info:
                await box.verify(hog, 0, FIELD, deadline=deadline())
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.message == "compiling needs too much memory"
        else:
            assert await box.verify(hog, 0, FIELD, deadline=deadline()) == ()
        assert await box.verify(ok_grammar(), 0, FIELD, deadline=deadline()) == ()
        assert child_pids(box) == [pid]  # the same child
    finally:
        box.close()


async def until_start_failed(box: Sandbox) -> str:
    t0 = time.monotonic()
    while not box._last_start_error:
        assert time.monotonic() - t0 < 120, "no start failure was reported"
        await asyncio.sleep(0.05)
    return box._last_start_error


@pytest.mark.parametrize(
    ("specs", "memory_mb", "error"),
    [
        # The child runs but cannot load the tokenizer: it says so.
        (["/nonexistent/tokenizer.json"], 4096, "cannot load tokenizers"),
        # The child dies before it is ready: under a 64 MB cap not even its compile thread's
        # stack fits. (Its exit status is not the point: the parent may kill it first.)
        (["default"], 64, "compile worker .* while starting"),
    ],
    ids=["bad-tokenizer", "dies-starting"],
)
async def test_a_child_that_cannot_start_makes_jobs_fail_with_the_reason(
    specs: list[str], memory_mb: int, error: str
) -> None:
    box = Sandbox(specs, ParserLimits(), SandboxConfig(workers=1, memory_mb=memory_mb))
    box.start()
    try:
        assert re.search(error, await until_start_failed(box))
        with pytest.raises(SandboxUnavailable, match=error):
            await box.verify(ok_grammar(), 0, FIELD, deadline=deadline(0.5))
        with pytest.raises(SandboxUnavailable, match=error):
            await box.wait_ready(0.5)
        assert box.ready_workers == 0
    finally:
        box.close()


async def test_starts_that_keep_failing_back_off_then_recover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each failed start waits twice as long as the one before before the next try (1 s, 2 s,
    ... up to 30 s); once a start works the child serves."""
    waits: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread().name.startswith("sandbox"):  # the sandbox's own threads
            waits.append(seconds)
            seconds = 0.001
        real_sleep(seconds)

    fails = 7
    real_start = sandbox_module._Child.start

    def start(child: Any, *args: Any) -> None:
        if len(waits) < fails:
            raise SandboxUnavailable("no tokenizer yet")
        real_start(child, *args)

    monkeypatch.setattr(sandbox_module.time, "sleep", sleep)
    monkeypatch.setattr(sandbox_module._Child, "start", start)
    box = Sandbox(["default"], ParserLimits(), SandboxConfig(workers=1))
    try:
        await started(box, 1)
        assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        assert await box.verify(ok_grammar(), 0, FIELD, deadline=deadline()) == ()
    finally:
        box.close()
