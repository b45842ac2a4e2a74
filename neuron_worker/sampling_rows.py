"""Per-row sampling parameters as the device receives them: one typed record per logits row.

The engine fills one :class:`SamplingRow` per row it samples; the device pads the rest of the
batch bucket with :data:`PAD_ROW`, the one padding rule: a greedy row without penalties, bias or
logprobs, whose penalty-table row is the pad slot. Host data only (pickled to tensor-parallel
followers as it is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PAD_ROW", "SamplingRow", "SamplingRows"]


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One logits row. The defaults are a padding row's (and a draft position's extras: drafts
    never carry penalties or logprobs)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    offset: int = 0  # the request's sampling counter at this position
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    slot: int | None = None  # penalty-table row (the request's KV slot); None: the pad slot
    raw_logprobs: bool = False  # logprobs of the model's distribution, not the processed one


PAD_ROW = SamplingRow()


@dataclass
class SamplingRows:
    """A step's rows (fewer than the logits rows: the rest are :data:`PAD_ROW`), the penalty
    table's updates to make first (occurrences to count, slots whose row starts over with their
    prompt) and whether any row asks for penalties or logprobs (their graphs run only then)."""

    rows: list[SamplingRow]
    count: list[tuple[int, int]] = field(default_factory=list)
    reset: list[tuple[int, list[int]]] = field(default_factory=list)
    any_penalty: bool = False
    any_logprobs: bool = False

    def padded(self, n: int) -> list[SamplingRow]:
        """The rows followed by padding rows, ``n`` in all."""
        return self.rows + [PAD_ROW] * (n - len(self.rows))
