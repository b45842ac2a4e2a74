"""The compile sandbox with real child processes: verdicts, crashes, deadlines and its two lanes.

Crashes and hangs come from the test-only fault hook, which the sandbox arms in its children with
the specs of `SandboxConfig.testing_faults` (the service's `--testing-faults`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import llguidance
import pytest

from grammar_service import metrics
from grammar_service.compiler import ParserLimits
from grammar_service.sandbox import Sandbox, SandboxConfig, SandboxCrashed
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
