"""A bounded LRU of compiled grammars, keyed by `grammar_id` (constraint + options + tokenizer).

Concurrent requests for the same missing key share one compilation (single flight). The compile
runs in a task the cache owns; each caller waits on it without owning it, so a caller that is
cancelled (its client went away) leaves the others waiting for the same compile. A compile whose
callers have all left still finishes and is cached: a client that retries after its deadline
finds it there, and stopping it would save nothing a client cannot also spend by just waiting.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc

from grammar_service.compiler import CompiledGrammar
from maskwire.rpc import RpcError


class CompileCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._items: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[CompiledGrammar]] = {}

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
        """Return (grammar, cached): `cached` when this caller did not start the compile. Errors
        are not cached: a bad constraint is recompiled (and rejected again) each time, which
        keeps the cache free of junk. Every caller gets the compile's result or its error."""
        hit = self.get(key)
        if hit is not None:
            return hit, True
        task = self._inflight.get(key)
        joined = task is not None
        if task is None:
            task = asyncio.ensure_future(self._compile(compile_fn))
            task.add_done_callback(functools.partial(self._finished, key))
            self._inflight[key] = task
        # `wait` returns when the task ends; cancelling this caller cancels the wait only.
        await asyncio.wait((task,))
        if task.cancelled():  # the compile itself was cancelled: only while the service stops
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE,
                "the compile was cancelled: the grammar service is stopping",
                reason="COMPILE_CANCELLED",
            )
        return task.result(), joined

    async def _compile(
        self, compile_fn: Callable[[], Awaitable[CompiledGrammar]]
    ) -> CompiledGrammar:
        item = await compile_fn()
        self.put(item)
        return item

    def _finished(self, key: str, task: asyncio.Task[CompiledGrammar]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        # A compile all of whose callers left: its error has nobody to go to, and is no bug.
        if not task.cancelled():
            task.exception()
