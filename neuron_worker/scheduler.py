"""Admission and bookkeeping: the bounded wait queue, KV cache slots, batch and sequence buckets.

The scheduler never touches the device or the network; the engine asks it which requests run
next and tells it when they finish.

Clients (gRPC peers: one per connection, e.g. each gateway pod) share the queue and the batch
slots fairly, so one client cannot take them all. A client alone may fill the whole queue; when
the queue is full, a client holding less than its fair share (the queue divided among the
clients with waiting requests, itself included) still gets in, in place of the newest waiting
call of the client furthest over its share, which is refused as if the queue had been full when
it came (RESOURCE_EXHAUSTED). A free slot goes to the oldest waiting request of the client with
the fewest running requests, between equals to the one admitted least recently (first come,
first served for a single client). Which free slot a request takes is the prefix cache's choice
(`neuron_worker.prefix_cache`): the one holding the most of its prompt. There are more slots
than the batch has rows (`kv_slots`): at most `max_batch` requests run, and the slots no request
runs in keep the prompts they hold for later requests. A request that shares a
longer prefix with one admitted in the same turn waits for that one's prompt pass and copies
the prefix in the next turn (`PrefixCache.worth_waiting`; once per request); the requests behind
it go ahead.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import Counter, deque
from collections.abc import Sequence

from neuron_worker.events import EngineError, ErrorKind
from neuron_worker.prefix_cache import PrefixCache
from neuron_worker.request import Request, State


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """lo, 2*lo, 4*lo, ... and always `hi` itself as the last bucket."""
    out: list[int] = []
    b = max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


def parse_buckets(text: str, hi: int, lo: int) -> list[int]:
    """`"1,2,4,8"` -> sorted buckets capped at `hi` (which is always included); "" -> powers of two."""
    if not text.strip():
        return pow2_buckets(lo, hi)
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if any(v <= 0 for v in values):
        raise ValueError(f"buckets must be positive: {text!r}")
    return sorted({v for v in values if v < hi} | {hi})


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """Smallest bucket >= n (buckets sorted); n above the largest is a caller bug."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class Scheduler:
    """Bounded queue of waiting requests and the set of running ones, one KV slot each."""

    def __init__(
        self,
        *,
        max_batch: int,
        kv_slots: int = 0,
        max_queue: int,
        max_seq_len: int,
        batch_buckets: Sequence[int],
        seq_buckets: Sequence[int],
        max_prefill_tokens: int,
        prefix_cache: bool = True,
    ) -> None:
        """At most `max_batch` requests run, each in one of `kv_slots` KV slots (at least
        `max_batch`; 0: `max_batch`): the slots no request runs in keep the prompts they hold.
        `prefix_cache`: whether a prompt reuses the K/V a slot holds for its prefix
        (`PrefixCache`)."""
        kv_slots = max(kv_slots, max_batch)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_seq_len = max_seq_len
        self.batch_buckets = list(batch_buckets)
        self.seq_buckets = list(seq_buckets)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(kv_slots))
        self.prefixes = PrefixCache(kv_slots, enabled=prefix_cache)
        # When each client with live requests last had one admitted (admission count).
        self._admitted_at: dict[str, int] = {}
        self._admissions = 0

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_room(self, peer: str, adding: int) -> None:
        """RESOURCE_EXHAUSTED unless `adding` requests of `peer` could be queued now (in place of
        other clients' waiting calls where `peer` is under its fair share). Changes nothing: a
        caller with slow work to do before :meth:`enqueue` (opening grammars) asks first."""
        self._make_room(peer, adding, remove=False)

    def enqueue(self, reqs: Sequence[Request]) -> list[Request]:
        """Queue the requests of one call (all the choices of an n > 1 call), all or none:
        RESOURCE_EXHAUSTED when they may not be. Returns the waiting requests that left the
        queue to make room for them: the caller fails them as refused."""
        shed = self._make_room(reqs[0].peer, len(reqs), remove=True)
        for req in reqs:
            req.state = State.WAITING
            self.waiting.append(req)
        return shed

    def _make_room(self, peer: str, adding: int, *, remove: bool) -> list[Request]:
        free = self.max_queue - len(self.waiting)
        if adding <= free:
            return []
        held = Counter(r.peer for r in self.waiting)
        share = self.max_queue // len(held.keys() | {peer})
        if held[peer] + adding > share:
            raise queue_full(self.max_queue)
        shed: list[Request] = []
        while len(shed) < adding - free:
            heaviest = max((p for p in held if p != peer), key=held.__getitem__)
            if held[heaviest] <= share:
                raise queue_full(self.max_queue)  # not reached: someone is over when it is full
            newest = next(r for r in reversed(self.waiting) if r.peer == heaviest and r not in shed)
            call = [
                r for r in self.waiting if r is newest or (newest.group and r.group == newest.group)
            ]
            shed += call
            held[heaviest] -= len(call)
        if remove:
            for r in shed:
                self.waiting.remove(r)
        return shed

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots within the prefill token budget: the oldest
        request of the client with the fewest running ones first (FIFO for one client)."""
        admitted: list[Request] = []
        coming: list[tuple[Sequence[int], str]] = []  # the admitted prompts, not computed yet
        later: set[int] = set()  # requests (by id) that wait for one of those
        longest = 0
        prefill_rows = 0
        running = Counter(r.peer for r in self.running)
        while len(self.running) < self.max_batch:
            at = self._next_waiting(running, later)
            if at is None:
                break
            req = self.waiting[at]
            # The choices of an n > 1 call are admitted together (one prefill row for them all).
            group = [req]
            while (
                req.group
                and at + len(group) < len(self.waiting)
                and self.waiting[at + len(group)].group == req.group
            ):
                group.append(self.waiting[at + len(group)])
            if len(group) > self.max_batch - len(self.running):
                break
            reused = self.prefixes.plan(req.prompt, self._free_slots, req.cache_salt).length
            if not req.waited and self.prefixes.worth_waiting(
                req.prompt, req.cache_salt, reused, coming
            ):
                # Once only: the slot it waits for may be taken before its next turn.
                req.waited = True
                later.update(id(member) for member in group)
                continue
            longest_next = max(longest, len(req.prompt) - reused)
            rows = self.batch_bucket(min(prefill_rows + 1, self.batch_buckets[-1]))
            if admitted and rows * prefill_len(longest_next) > self.max_prefill_tokens:
                break
            self._admissions += 1
            self._admitted_at[req.peer] = self._admissions
            for member in group:
                del self.waiting[at]
                running[member.peer] += 1
                member.reuse = self.prefixes.take(
                    member.prompt, self._free_slots, member.cache_salt
                )
                member.slot = member.reuse.slot
                self._free_slots.remove(member.slot)
                member.state = State.RUNNING
                self.running.append(member)
                admitted.append(member)
            coming.append((req.prompt, req.cache_salt))
            prefill_rows += 1
            longest = longest_next
        if len(self._admitted_at) > len(running):  # forget clients with nothing running
            self._admitted_at = {p: n for p, n in self._admitted_at.items() if running[p]}
        return admitted

    def _next_waiting(self, running: Counter[str], later: set[int]) -> int | None:
        """Index in the queue of the request admitted next: the oldest one of the client with
        the fewest running requests (`running`, by peer), between equals of the one admitted
        least recently; None when every waiting request waits for a later turn (`later`)."""
        first: dict[str, int] = {}
        for i, r in enumerate(self.waiting):
            if id(r) not in later:
                first.setdefault(r.peer, i)
        if not first:
            return None
        at = self._admitted_at
        return first[min(first, key=lambda p: (running[p], at.get(p, 0), first[p]))]

    def release(self, req: Request, *, answered: bool = False) -> None:
        """A request finished: free its slot (or drop it from the queue). `answered`: it ended
        normally, so its slot's K/V cover its prompt and answer (`PrefixCache.refresh`)."""
        if req.state is State.RUNNING:
            self.running.remove(req)
            self._free_slots.append(req.slot)
            written = (req.prompt + req.output)[: self.max_seq_len] if answered else []
            self.prefixes.release(req.slot, written)
            req.slot = -1
        elif req.state is State.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.state = State.FINISHED

    def refresh(self, limit: int) -> tuple[int, int, list[int]] | None:
        """The next prompt pass that rewrites a finished answer into its free slot
        (`PrefixCache.refresh`), or None."""
        return self.prefixes.refresh(self._free_slots, limit)

    def batch_bucket(self, n: int) -> int:
        return bucket_for(self.batch_buckets, n)

    def seq_bucket(self, n: int) -> int:
        """`kv_len` for a batch whose longest position + 1 is n."""
        return bucket_for(self.seq_buckets, n)


def queue_full(max_queue: int) -> EngineError:
    return EngineError(
        ErrorKind.RESOURCE_EXHAUSTED,
        f"the worker's queue is full ({max_queue} waiting requests); retry later",
        reason="QUEUE_FULL",
    )


def prefill_len(n: int) -> int:
    """Padded token count of a prefill row: next power of two >= n (at least 8)."""
    b = 8
    while b < n:
        b *= 2
    return b


def forward_shapes(
    batch_buckets: Sequence[int], token_buckets: Sequence[int], seq_buckets: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Every (batch, tokens per row, kv_len) forward shape the engine can produce: a row padded to
    token bucket t carries more tokens than the bucket below it, so its last position, and with
    it kv_len, is at least that many."""
    shapes: list[tuple[int, int, int]] = []
    below = 0
    for t in token_buckets:
        lowest_kv = bucket_for(seq_buckets, below + 1)
        for kv in seq_buckets:
            if kv >= lowest_kv:
                shapes.extend((n, t, kv) for n in batch_buckets)
        below = t
    return shapes
