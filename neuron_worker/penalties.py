"""Repetition penalties and logit bias on the device, before the grammar mask.

:func:`apply_penalties` is a pure static-shape function (one graph per batch bucket, like the
sampler's): every row carries its own ``presence`` / ``frequency`` / ``repetition`` penalties and a
fixed-width logit-bias buffer of :data:`BIAS_WIDTH` ``(token id, bias)`` pairs, so no request
changes a shape. It runs before :func:`neuron_worker.sampler.sample_tokens`, whose mask sets every
grammar-forbidden column to ``-inf`` afterwards: no bias can re-allow a forbidden token.

:class:`OccurrenceTable` keeps, per KV-cache slot, how often each token occurred in the output
(presence / frequency penalties) and which tokens the prompt holds (the repetition penalty counts
prompt and output, as Hugging Face and vLLM do). It lives on the device; the engine adds the tokens
a request generated (sampled and forced) before each of its penalised samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from neuron_worker.scheduler import next_pow2

__all__ = ["BIAS_WIDTH", "OccurrenceTable", "PenaltyTensors", "apply_penalties"]

BIAS_WIDTH = 300
"""Logit-bias entries per row (OpenAI's limit per request); unused entries are ``(0, 0.0)``."""


@dataclass
class PenaltyTensors:
    """Per-row penalty parameters on the sampler's device (``[N]`` and ``[N, BIAS_WIDTH]``)."""

    presence: Tensor  # float32 [N]; 0 = off
    frequency: Tensor  # float32 [N]; 0 = off
    repetition: Tensor  # float32 [N]; 1 = off
    bias_ids: Tensor  # int64 [N, BIAS_WIDTH]
    bias_values: Tensor  # float32 [N, BIAS_WIDTH]

    @classmethod
    def build(
        cls,
        *,
        presence: Sequence[float],
        frequency: Sequence[float],
        repetition: Sequence[float],
        logit_bias: Sequence[dict[int, float]],
        n_rows: int,
        device: torch.device | str = "cpu",
    ) -> PenaltyTensors:
        """From per-row Python values, padded to ``n_rows`` with rows that change nothing."""
        n = len(presence)
        if not (len(frequency) == len(repetition) == len(logit_bias) == n) or n > n_rows:
            raise ValueError("penalty parameter lists differ in length or exceed n_rows")
        pad = n_rows - n
        ids = torch.zeros(n_rows, BIAS_WIDTH, dtype=torch.int64)
        values = torch.zeros(n_rows, BIAS_WIDTH, dtype=torch.float32)
        for i, bias in enumerate(logit_bias):
            if len(bias) > BIAS_WIDTH:
                raise ValueError(f"at most {BIAS_WIDTH} logit_bias entries per row")
            if bias:
                ids[i, : len(bias)] = torch.tensor(list(bias.keys()), dtype=torch.int64)
                values[i, : len(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)

        def floats(xs: Sequence[float], fill: float) -> Tensor:
            return torch.tensor(
                [float(x) for x in xs] + [fill] * pad, dtype=torch.float32, device=device
            )

        return cls(
            presence=floats(presence, 0.0),
            frequency=floats(frequency, 0.0),
            repetition=floats([r if r > 0 else 1.0 for r in repetition], 1.0),
            bias_ids=ids.to(device),
            bias_values=values.to(device),
        )


def apply_penalties(
    logits: Tensor,
    counts: Tensor,
    prompt_seen: Tensor,
    presence: Tensor,
    frequency: Tensor,
    repetition: Tensor,
    bias_ids: Tensor,
    bias_values: Tensor,
) -> Tensor:
    """Penalised float32 logits ``[N, L]``; pure and static-shape.

    ``counts``: int32 ``[N, L]`` occurrences of each token in the row's output; ``prompt_seen``:
    bool ``[N, L]``. In order (vLLM's): repetition penalty on every token of prompt or output
    (positive logits divided by it, negative ones multiplied), then ``- frequency * count -
    presence * (count > 0)`` (OpenAI's definition), then the logit bias added.
    """
    x = logits.float()
    cnt = counts.to(torch.float32)
    occurred = cnt > 0
    rep = repetition.unsqueeze(1)
    x = torch.where(occurred | prompt_seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency.unsqueeze(1) * cnt - presence.unsqueeze(1) * occurred.to(torch.float32)
    return x.scatter_add(1, bias_ids, bias_values)


class OccurrenceTable:
    """Token occurrence counts per KV-cache slot, on the device.

    ``counts`` int32 ``[slots, L + 1]`` and ``prompt_seen`` bool ``[slots, L + 1]``: the last
    column is a scratch column that padding entries write to, so every update has a bucketed
    length (powers of two) and never a per-request shape.
    """

    def __init__(self, *, slots: int, logits_size: int, device: torch.device | str) -> None:
        self.logits_size = logits_size
        self.scratch = logits_size
        self.device = torch.device(device)
        self.counts = torch.zeros(slots, logits_size + 1, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(slots, logits_size + 1, dtype=torch.bool, device=device)

    def reset(self, slot: int, prompt: Sequence[int]) -> None:
        """A new request in ``slot``: no output yet, its prompt tokens seen."""
        self.counts[slot] = 0
        self.prompt_seen[slot] = False
        index = _padded(list(prompt), self.scratch)
        self.prompt_seen[slot].index_fill_(0, index.to(self.device), True)

    def add(self, entries: Sequence[tuple[int, int]]) -> None:
        """Count ``(slot, token)`` occurrences (a token may repeat)."""
        if not entries:
            return
        slots = _padded([s for s, _ in entries], 0)
        tokens = _padded([t for _, t in entries], self.scratch)
        ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
        self.counts.index_put_(
            (slots.to(self.device), tokens.to(self.device)), ones, accumulate=True
        )

    def rows(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """``counts`` and ``prompt_seen`` of each slot in ``slots`` (int64 ``[N]``), ``[N, L]``."""
        counts = self.counts.index_select(0, slots)[:, : self.logits_size]
        seen = self.prompt_seen.index_select(0, slots)[:, : self.logits_size]
        return counts, seen


def _padded(values: list[int], fill: int) -> Tensor:
    """``values`` padded with ``fill`` to the next power of two (at least 1)."""
    return torch.tensor(values + [fill] * (next_pow2(len(values)) - len(values)), dtype=torch.int64)
