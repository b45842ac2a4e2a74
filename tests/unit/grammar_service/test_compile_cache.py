from __future__ import annotations

import asyncio
import gc
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from grammar_service.compile_cache import ENTRY_BASE_BYTES, CompileCache, entry_bytes
from maskwire.rpc import RpcError


class Item:
    def __init__(self, key: str, grammar: str = "start: /a/") -> None:
        self.grammar_id = key
        self.grammar = grammar


def sized(key: str, size: int) -> Any:
    """An item whose `entry_bytes` is `size` (rounded down to the per-byte charge)."""
    item = Item(key, "")
    per_byte = entry_bytes(Item("x", "ab")) - entry_bytes(Item("x", "a"))
    item.grammar = "g" * ((size - ENTRY_BASE_BYTES) // per_byte)
    return item


def returning(item: Any) -> Any:
    async def run() -> Any:
        return item

    return run


async def test_lru_eviction_and_single_flight() -> None:
    cache = CompileCache(2)
    calls: list[str] = []

    def make(key: str) -> Any:
        async def run() -> Any:
            calls.append(key)
            await asyncio.sleep(0.01)
            return Item(key)

        return run

    (a1, c1), (a2, c2) = await asyncio.gather(
        cache.get_or_compile("a", make("a")), cache.get_or_compile("a", make("a"))
    )
    assert a1 is a2 and calls == ["a"] and {c1, c2} == {False, True}
    await cache.get_or_compile("b", make("b"))
    await cache.get_or_compile("c", make("c"))
    assert cache.get("a") is None and cache.get("b") is not None and len(cache) == 2


async def test_errors_are_not_cached() -> None:
    cache = CompileCache(4)

    async def fail() -> Any:
        raise ValueError("bad")

    for _ in range(2):
        with pytest.raises(ValueError):
            await cache.get_or_compile("k", fail)
    assert cache.get("k") is None


# -- waiters of one compile --------------------------------------------------------------------


def gated(gate: asyncio.Future[Any], calls: list[int]) -> Any:
    """A compile that ends when the test resolves `gate` (with an item, or an exception)."""

    async def run() -> Any:
        calls.append(1)
        return await gate

    return run


async def test_a_cancelled_waiter_leaves_the_compile_to_the_others() -> None:
    cache = CompileCache(4)
    gate: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    calls: list[int] = []
    first = asyncio.create_task(cache.get_or_compile("k", gated(gate, calls)))
    second = asyncio.create_task(cache.get_or_compile("k", gated(gate, calls)))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    assert first.cancelled() and not second.done() and not gate.cancelled()
    item = Item("k")
    gate.set_result(item)
    assert await second == (item, True)
    assert cache.get("k") is item and calls == [1]


async def test_a_compile_every_waiter_left_still_finishes_and_is_cached() -> None:
    cache = CompileCache(4)
    gate: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    calls: list[int] = []
    waiters = [asyncio.create_task(cache.get_or_compile("k", gated(gate, calls))) for _ in "ab"]
    await asyncio.sleep(0)
    for w in waiters:
        w.cancel()
    await asyncio.sleep(0)
    # A caller that comes back while it runs joins it instead of starting another.
    again = asyncio.create_task(cache.get_or_compile("k", gated(gate, calls)))
    await asyncio.sleep(0)
    item = Item("k")
    gate.set_result(item)
    assert await again == (item, True)
    assert calls == [1]
    assert await cache.get_or_compile("k", gated(gate, calls)) == (item, True)


async def test_every_waiter_gets_the_error_also_after_one_left() -> None:
    cache = CompileCache(4)
    gate: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    calls: list[int] = []
    waiters = [asyncio.create_task(cache.get_or_compile("k", gated(gate, calls))) for _ in "abc"]
    await asyncio.sleep(0)
    waiters[0].cancel()
    await asyncio.sleep(0)
    gate.set_exception(
        RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow", reason="COMPILE_TIMEOUT")
    )
    for w in waiters[1:]:
        with pytest.raises(RpcError) as e:
            await w
        assert e.value.reason == "COMPILE_TIMEOUT"
    assert waiters[0].cancelled() and cache.get("k") is None


async def test_an_error_nobody_waits_for_is_not_reported_as_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
    try:
        cache = CompileCache(4)
        gate: asyncio.Future[Any] = loop.create_future()
        waiter = asyncio.create_task(cache.get_or_compile("k", gated(gate, [])))
        await asyncio.sleep(0)
        waiter.cancel()
        gate.set_exception(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
        await asyncio.sleep(0.01)
        del gate, waiter  # the compile task is garbage now: unretrieved errors are logged here
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert unhandled == []


async def test_waiters_of_a_cancelled_compile_get_a_status() -> None:
    cache = CompileCache(4)
    gate: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    waiters = [asyncio.create_task(cache.get_or_compile("k", gated(gate, []))) for _ in "ab"]
    await asyncio.sleep(0)
    gate.cancel()  # e.g. the service stopping under the compile
    for w in waiters:
        with pytest.raises(RpcError) as e:
            await w
        assert e.value.code is grpc.StatusCode.UNAVAILABLE
        assert e.value.reason == "COMPILE_CANCELLED"
    # The key is free again: the next caller compiles anew.
    item = Item("k")
    assert await cache.get_or_compile("k", returning(item)) == (item, False)


async def test_a_compile_cancelled_before_it_ran_frees_its_key() -> None:
    cache = CompileCache(4)
    waiter = asyncio.create_task(cache.get_or_compile("k", returning(Item("k"))))
    await asyncio.sleep(0)  # the waiter started the compile, which has not run yet
    (compile_task,) = asyncio.all_tasks() - {asyncio.current_task(), waiter}
    compile_task.cancel()
    with pytest.raises(RpcError):
        await waiter
    item = Item("k")
    assert await cache.get_or_compile("k", returning(item)) == (item, False)


# -- bytes ---------------------------------------------------------------------------------------


def test_entries_are_charged_by_grammar_size() -> None:
    small, big = entry_bytes(Item("a", "x")), entry_bytes(Item("a", "x" * 1000))
    assert small >= ENTRY_BASE_BYTES and big - small >= 999 * 100


async def test_evicts_least_recently_used_to_stay_under_the_byte_bound() -> None:
    mib = 1 << 20
    cache = CompileCache(100, capacity_bytes=10 * mib)
    for key in "abcd":
        await cache.get_or_compile(key, returning(sized(key, 3 * mib)))
    assert cache.get("a") is None and [cache.get(k) is not None for k in "bcd"] == [True] * 3
    assert cache.bytes <= 10 * mib and len(cache) == 3
    cache.get("b")  # used: "c" is now the oldest
    await cache.get_or_compile("e", returning(sized("e", 3 * mib)))
    assert cache.get("c") is None and cache.get("b") is not None
    assert REGISTRY.get_sample_value("maskwire_grammar_cache_bytes") == cache.bytes
    assert REGISTRY.get_sample_value("maskwire_grammar_cache_entries") == len(cache) == 3


async def test_an_entry_over_the_byte_bound_is_served_not_kept() -> None:
    mib = 1 << 20
    cache = CompileCache(100, capacity_bytes=4 * mib)
    await cache.get_or_compile("a", returning(sized("a", mib)))
    item, cached = await cache.get_or_compile("huge", returning(sized("huge", 5 * mib)))
    assert item.grammar_id == "huge" and not cached
    assert cache.get("huge") is None and cache.get("a") is not None
