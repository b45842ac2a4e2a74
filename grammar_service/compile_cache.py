"""A bounded LRU of compiled grammars, keyed by `grammar_id` (constraint + options + tokenizer).

Concurrent requests for the same missing key share one compilation (single flight).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from grammar_service.compiler import CompiledGrammar


class CompileCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._items: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[CompiledGrammar]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> CompiledGrammar | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, item: CompiledGrammar) -> None:
        if self.capacity == 0:
            return
        self._items[item.grammar_id] = item
        self._items.move_to_end(item.grammar_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    async def get_or_compile(
        self, key: str, compile_fn: Callable[[], Awaitable[CompiledGrammar]]
    ) -> tuple[CompiledGrammar, bool]:
        """Return (grammar, cached). Errors are not cached: a bad constraint is recompiled (and
        rejected again) each time, which keeps the cache free of junk."""
        hit = self.get(key)
        if hit is not None:
            return hit, True
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending), True
        fut: asyncio.Future[CompiledGrammar] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            item = await compile_fn()
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        else:
            fut.set_result(item)
            self.put(item)
            return item, False
        finally:
            del self._inflight[key]
