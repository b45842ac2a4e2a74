"""Prompt prefix reuse: the K/V a KV slot holds for a prompt serve a later prompt that starts
with the same tokens (a shared system prompt, a tool list, a repeated request, the earlier turns
of a conversation), which then runs only its new tokens through the prompt pass.

Each slot remembers the prompt whose K/V it holds, for as long as nothing overwrites them: while
its request runs, and after it finishes until the slot is taken again. The worker has more slots
than requests run at once (`EngineConfig.prefix_cache_slots`), so the cache keeps the prompts of
that many finished requests beside the running ones. Only K/V written by a
prompt pass count: a prompt pass runs the dense weights, the steps the quantized ones
(`neuron_worker.model.linear`), so a prompt reusing a step's K/V would see other numbers than
one that computes them. A request's generated tokens and the grammar's forced ones are never
remembered (a grammar may take forced tokens back).

Requests reuse only what requests with the same cache salt (`GenerateRequest.cache_salt`, a
tenant's) left: a tenant cannot tell from response times whether another sent a prompt.

A new request takes, of the free slots, the one holding the longest prefix of its prompt and
nothing else (an earlier turn of its conversation, the same prompt, or nothing at all), where
its prompt pass overwrites nothing another request could reuse; where every free slot holds
something else, the one used least recently. Where another slot (free or running) holds a longer
prefix of its prompt, by at least `MIN_COPY` tokens, its prompt pass first copies that prefix
into its slot (`neuron_worker.graphs.Pass.copies`): requests sharing a system prompt each keep
their own question (and answer) in their own slot. At least the prompt's last token always
runs: its logits are the request's first draw.

A request's answer is written to its slot by the steps, so it is not held; yet a conversation's
next turn (an agent's next call) starts with the whole exchange, answer included. While the
worker is idle, prompt passes rewrite a finished answer into its slot (`refresh`, a few tokens
per pass, the most recent answer first): the slot then holds the exchange, and the next turn
computes only its new message.

Requests that arrive together with a prefix no slot holds yet (a new system prompt) would each
compute it in the same prompt pass. Instead a request waits for the pass of one admitted before
it that writes at least `MIN_COPY` more of its prefix (`worth_waiting`), and copies that prefix
in the next one: on a CPU, where a prompt pass costs each token it computes, 8 requests sharing a
500-token system prompt compute it once rather than 8 times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A copy between slots costs a few copies per layer (~1 ms on CPU; a small graph on XLA); below
# this many tokens the prompt pass computes them instead.
MIN_COPY = 16


@dataclass(frozen=True)
class Reuse:
    """Where a request's prompt pass starts: `slot` is its own; positions [0, `length`) of its
    prompt are there already, or are copied from slot `source` first (`source` = -1: no copy)."""

    slot: int
    length: int = 0
    source: int = -1


NO_REUSE = Reuse(-1)
"""A request not admitted yet."""


class PrefixCache:
    """The prompt tokens whose K/V each of `slots` KV slots holds, and the slot choice that
    reuses them (module docstring). Disabled, it remembers nothing: a request takes the free
    slot used least recently and computes its whole prompt."""

    def __init__(self, slots: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held = [np.zeros(0, dtype=np.int64) for _ in range(slots)]
        self._salts = [""] * slots  # the cache salt of the request that wrote each slot's prompt
        self._used = [0] * slots  # when each slot was last taken or freed (a counter)
        self._clock = 0
        # A finished request's prompt and answer: the tokens its slot has K/V for, from the
        # prompt pass (held) and from the steps (to refresh).
        self._written = [np.zeros(0, dtype=np.int64) for _ in range(slots)]

    def held(self, slot: int) -> list[int]:
        """The prompt tokens whose K/V `slot` holds."""
        return self._held[slot].tolist()

    def plan(self, prompt: Sequence[int], free: Sequence[int], salt: str = "") -> Reuse:
        """The slot among `free` (non-empty) a new request with `prompt` and cache `salt` would
        take, and the prefix it would reuse; changes nothing."""
        tokens = np.asarray(prompt, dtype=np.int64)
        held = [self._match(s, tokens, len(tokens) - 1, salt) for s in range(len(self._held))]
        # A slot whose whole content starts the prompt (or an empty one) loses nothing to it;
        # else the slot used least recently gives up what it holds, not one that matched.
        whole = [s for s in free if self._starts(s, tokens, salt)]
        if whole:
            slot = max(whole, key=lambda s: (held[s], -self._used[s]))
        else:
            slot = min(free, key=lambda s: self._used[s])
        best = max(range(len(held)), key=held.__getitem__)
        if held[best] - held[slot] >= MIN_COPY:
            return Reuse(slot, held[best], best)
        return Reuse(slot, held[slot])

    def take(self, prompt: Sequence[int], free: Sequence[int], salt: str = "") -> Reuse:
        """:meth:`plan`, and the slot taken: until its prompt pass has run it holds only the
        prefix of `prompt` it held already (a copy into it happens with that pass)."""
        reuse = self.plan(prompt, free, salt)
        tokens = np.asarray(prompt, dtype=np.int64)
        kept = self._match(reuse.slot, tokens, len(prompt) - 1, salt)
        self._held[reuse.slot] = self._held[reuse.slot][:kept]
        self._written[reuse.slot] = self._held[reuse.slot]
        self._salts[reuse.slot] = salt
        self._touch(reuse.slot)
        return reuse

    def hold(self, slot: int, prompt: Sequence[int]) -> None:
        """A prompt pass wrote the K/V of `prompt` into `slot` (or copied them there)."""
        if self.enabled:
            self._held[slot] = np.asarray(prompt, dtype=np.int64)

    def worth_waiting(
        self,
        prompt: Sequence[int],
        salt: str,
        reused: int,
        coming: Sequence[tuple[Sequence[int], str]],
    ) -> bool:
        """Whether a request that would reuse `reused` tokens of `prompt` now should wait for
        the prompt pass of `coming` (prompt and cache salt of each request admitted before it
        whose pass has not run): one of them writes at least `MIN_COPY` more tokens of its
        prefix, which it copies after that pass instead of computing them in the same one."""
        if not self.enabled:
            return False
        tokens = np.asarray(prompt, dtype=np.int64)
        limit = len(tokens) - 1
        return any(
            _common_prefix(tokens, np.asarray(other, dtype=np.int64), limit) - reused >= MIN_COPY
            for other, other_salt in coming
            if other_salt == salt
        )

    def release(self, slot: int, written: Sequence[int] = ()) -> None:
        """The slot's request finished: its prompt stays for later requests. `written`: the
        prompt and answer of one that ended normally, whose K/V the slot has (`refresh`)."""
        if self.enabled and len(written) > len(self._held[slot]):
            self._written[slot] = np.asarray(written, dtype=np.int64)
        self._touch(slot)

    def refresh(self, free: Sequence[int], limit: int) -> tuple[int, int, list[int]] | None:
        """The next prompt pass that rewrites a finished answer (module docstring): (slot,
        start, tokens), at most `limit` tokens of the most recently freed slot among `free`
        whose answer is not held yet; None when there is none. :meth:`refreshed` once the pass
        ran."""
        pending = [s for s in free if len(self._written[s]) > len(self._held[s])]
        if limit <= 0 or not pending:
            return None
        slot = max(pending, key=lambda s: self._used[s])
        start = len(self._held[slot])
        return slot, start, self._written[slot][start : start + limit].tolist()

    def refreshed(self, slot: int, count: int) -> None:
        """A pass rewrote the next `count` tokens of `slot`'s answer (:meth:`refresh`)."""
        self._held[slot] = self._written[slot][: len(self._held[slot]) + count]

    def _starts(self, slot: int, tokens: np.ndarray, salt: str) -> bool:
        """Whether all that `slot` holds is a prefix of `tokens` (empty: yes)."""
        n = len(self._held[slot])
        return n == 0 or self._match(slot, tokens, len(tokens), salt) == n

    def _match(self, slot: int, tokens: np.ndarray, limit: int, salt: str) -> int:
        return _common_prefix(self._held[slot], tokens, limit) if self._salts[slot] == salt else 0

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._used[slot] = self._clock


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
