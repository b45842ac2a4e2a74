"""A bounded LRU of compiled grammars, keyed by `grammar_id` (constraint + options + tokenizer).

Bounded twice: by entries and by bytes. A compiled grammar's memory is not measurable from Python
(it lives in llguidance's lexer and parser tables, which grow as requests use the grammar), so
each entry is charged an estimate from the size of its grammar text, `entry_bytes`, calibrated on
measurements (docs/operations.md, "Memory of a grammar replica").

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

from grammar_service import metrics
from grammar_service.compiler import CompiledGrammar
from grammar_service.config import CompileSettings
from maskwire.rpc import RpcError

# What one compiled grammar holds, estimated: a fixed part (its matcher and tables for the
# tokenizer; ~150 KiB measured for a small JSON schema), plus a part per byte of the llguidance
# grammar text (measured 20 to 190 retained bytes per byte with use, by kind; JSON schemas with
# many nested objects are the most).
ENTRY_BASE_BYTES = 160 << 10
ENTRY_BYTES_PER_GRAMMAR_BYTE = 200


def entry_bytes(item: CompiledGrammar) -> int:
    """The memory charged for keeping `item` in the cache."""
    return ENTRY_BASE_BYTES + ENTRY_BYTES_PER_GRAMMAR_BYTE * len(item.grammar.encode())


class CompileCache:
    def __init__(self, capacity: int, capacity_bytes: int = CompileSettings.cache_bytes) -> None:
        """`capacity`: entries kept; `capacity_bytes`: their estimated memory (`entry_bytes`)."""
        self.capacity = max(0, capacity)
        self.capacity_bytes = max(0, capacity_bytes)
        self._items: OrderedDict[str, tuple[CompiledGrammar, int]] = OrderedDict()
        self._bytes = 0
        self._inflight: dict[str, asyncio.Task[CompiledGrammar]] = {}
        self._publish()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """The estimated memory of the grammars kept."""
        return self._bytes

    def get(self, key: str) -> CompiledGrammar | None:
        entry = self._items.get(key)
        if entry is None:
            return None
        self._items.move_to_end(key)
        return entry[0]

    def put(self, item: CompiledGrammar) -> None:
        size = entry_bytes(item)
        if self.capacity == 0 or size > self.capacity_bytes:
            return  # served to its callers, never kept
        old = self._items.pop(item.grammar_id, None)
        if old is not None:
            self._bytes -= old[1]
        self._items[item.grammar_id] = (item, size)
        self._bytes += size
        while len(self._items) > self.capacity or self._bytes > self.capacity_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self._bytes -= evicted
        self._publish()

    def _publish(self) -> None:
        metrics.CACHE_BYTES.set(self._bytes)
        metrics.CACHE_ENTRIES.set(len(self._items))

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
