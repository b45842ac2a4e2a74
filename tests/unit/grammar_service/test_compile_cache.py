from __future__ import annotations

import asyncio
from typing import Any

import pytest

from grammar_service.compile_cache import CompileCache


class Item:
    def __init__(self, key: str) -> None:
        self.grammar_id = key


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
