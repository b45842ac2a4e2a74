"""Draft tokens for speculative decoding: n-gram (prompt-lookup) proposals and an adaptive budget.

:class:`NgramDrafter` looks at one request's tokens (prompt + output): it takes the longest recent
suffix of `max_n` down to `min_n` tokens that occurred earlier and proposes the tokens that
followed its latest earlier occurrence. An index of n-gram -> latest continuation start is kept
per request and extended incrementally, so a proposal costs O(max_n) dictionary look-ups.

:class:`DraftBudget` decides how many drafts a request gets per step: it grows after fully
accepted drafts, halves after fully rejected ones and, after a run of misses, pauses drafting for
a cooldown that doubles each time, so a request whose text never repeats soon pays nothing.

The drafter is deterministic: with the acceptance rule of the engine (a draft is kept iff the
token sampled at its position equals it) the output distribution is exactly the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DraftConfig:
    """Speculation settings (CLI: `--speculative`, `--num-draft-tokens`, `--ngram-min/max`)."""

    num_draft_tokens: int = 4
    min_n: int = 1
    max_n: int = 4
    # Most tokens in one verification pass, all rows together (0 = no limit): drafts beyond it
    # are not proposed (see `neuron_worker.engine`, `_plan_drafts`).
    pass_tokens: int = 0
    # Consecutive fully rejected proposals before drafting pauses.
    patience: int = 2
    # First pause, in steps (doubles per pause, capped at `max_cooldown`).
    cooldown: int = 4
    max_cooldown: int = 64

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")
        if self.pass_tokens < 0:
            raise ValueError("pass_tokens must be >= 0")


class NgramDrafter:
    """Prompt-lookup proposals for one request (module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # (n-gram) -> index where its latest indexed occurrence's continuation starts.
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in `_index`

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the request's history."""
        self._tokens.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix ([] when no suffix of `min_n` tokens or more occurred before)."""
        toks = self._tokens
        end = len(toks)
        if k <= 0 or end < self.min_n + 1:
            return []
        # Index every n-gram that ends before the last token (so it has a continuation): the
        # suffix itself is indexed only once it is no longer the suffix.
        for stop in range(self._indexed, end - 1):
            for n in range(self.min_n, self.max_n + 1):
                if stop + 1 >= n:
                    self._index[tuple(toks[stop + 1 - n : stop + 1])] = stop + 1
        self._indexed = max(self._indexed, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._index.get(tuple(toks[end - n :]))
            if start is not None:
                return toks[start : start + k]
        return []


@dataclass
class DraftBudget:
    """How many drafts one request gets per step (module docstring)."""

    config: DraftConfig
    k: int = 0
    misses: int = 0
    paused: int = 0  # steps left without drafting
    pauses: int = 0
    proposed: int = field(default=0)
    accepted: int = field(default=0)

    def __post_init__(self) -> None:
        if self.k <= 0:
            self.k = self.config.num_draft_tokens

    def want(self) -> int:
        """Drafts to ask the drafter for this step (0 while paused; counts the pause down)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int) -> None:
        """The outcome of a verification: `proposed` drafts reached the forward pass and the
        model agreed with the first `accepted` of them."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        c = self.config
        if accepted == proposed:
            self.k = min(c.num_draft_tokens, self.k + 1)
            self.misses = 0
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self.misses += 1
            if self.misses >= c.patience:
                self.paused = min(c.cooldown << self.pauses, c.max_cooldown)
                self.pauses += 1
                self.misses = 0
        else:
            self.k = max(1, accepted + 1)
            self.misses = 0


def accepted_prefix(drawn: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts verification keeps: `drawn[j]` is the token the sampler drew
    (masked, from the target's distribution) at draft `j`'s position; a draft is kept while it
    equals the draw. With greedy rows that is "the masked argmax equals the draft"; with
    sampling it is exact speculative sampling for a deterministic drafter (a draft `d` survives
    with probability p(d), and the draw that replaces a rejected one follows p restricted to
    tokens other than `d`, the residual distribution). The caller emits `drawn[: a + 1]`."""
    for j, d in enumerate(drafts):
        if j >= len(drawn) or drawn[j] != d:
            return j
    return len(drafts)
