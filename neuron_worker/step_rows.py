"""A step's rows as the device receives them: the host packing of forward passes and sampling.

A :class:`ForwardBatch` is the rows of one forward pass (a request's tokens to write and the
positions it draws at); :meth:`ForwardBatch.pack` makes the pass's arrays. A :class:`Draw` names
one logits row to sample (its request, mask row and random counter); :func:`sample_batch` makes
the sampler's input from the step's draws and the grammar's answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from neuron_worker.grammar_client import RowOutcome
from neuron_worker.graphs import ForwardRunner, Pass
from neuron_worker.request import Request
from neuron_worker.sampling_rows import PAD_ROW, SamplingRow, SamplingRows
from neuron_worker.step_device import SampleBatch

__all__ = ["Answers", "Draw", "ForwardBatch", "Row", "sample_batch"]

Answers = Mapping[Request, RowOutcome]
"""The grammar's answers of one step, by request (unconstrained requests have none)."""


class Draw(NamedTuple):
    """One logits row to sample: the request's `row`-th position of this step (its mask row
    `row`), drawn with the random counter `sampled + counter`."""

    req: Request
    row: int = 0
    counter: int = 0


@dataclass
class Row:
    """One request's slice of a forward pass: tokens to write starting at `start`; its last
    `outputs` tokens are the positions the pass draws at (more than one: speculative
    verification), those `wanted` names with logits."""

    req: Request
    tokens: list[int]
    start: int
    outputs: int = 1
    own_drafts: int = 0  # leading drafts that are the drafter's (the rest are the grammar's)
    # (start, count): drafts[start : start + count] are tokens the grammar forces, kept without
    # a sampling step (`RowOutcome.forced_jump`).
    jump: tuple[int, int] = (0, 0)

    def wanted(self) -> list[int]:
        """Which of the last `outputs` positions the pass returns logits for: all but the
        forced drafts', which are kept whatever is drawn there (an LM head row and a sampling
        row saved each; at c1 a field's three forced key tokens keep a verification pass within
        one read of the head's weights)."""
        start, count = self.jump
        return [j for j in range(self.outputs) if not start <= j < start + count]

    def positions(self) -> list[Draw]:
        """The draw of each logits row the pass returns for it: a forced draft's position has
        none, as a jump-forward token takes no counter."""
        start, count = self.jump
        return [Draw(self.req, j, j - min(max(j - start, 0), count)) for j in self.wanted()]


@dataclass
class ForwardBatch:
    """The rows of one forward pass and its kind (a metrics label; "prefill" and "refresh", a
    finished answer rewritten into its slot, pick the prefill graph): "prefill", "refresh",
    "decode", "jump_forward" or "verify". `copies`: (source slot, row's slot,
    length) prompt prefixes to copy into the rows' slots before the pass (a prefix another slot
    holds, `neuron_worker.prefix_cache`)."""

    rows: list[Row]
    kind: str
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    def pack(self, runner: ForwardRunner, pad_slot: int) -> Pass:
        """The pass's arrays, padded to the runner's shapes; logits come back for each row's
        `wanted` positions, row after row (then padding rows: garbage)."""
        rows = self.rows
        end = max(row.start + len(row.tokens) for row in rows)
        n, t, kv_len = runner.shape(len(rows), max(len(r.tokens) for r in rows), end)
        wanted = [row.wanted() for row in rows]
        count = runner.logits_count(n, sum(map(len, wanted)), max(map(len, wanted)))
        tokens = np.zeros((n, t), dtype=np.int64)
        pos = np.full((n, t), -1, dtype=np.int64)
        slots = np.full(n, pad_slot, dtype=np.int64)
        last = np.zeros(count, dtype=np.int64)
        o = 0
        for i, (row, want) in enumerate(zip(rows, wanted, strict=True)):
            k = len(row.tokens)
            tokens[i, :k] = row.tokens
            pos[i, :k] = np.arange(row.start, row.start + k)
            slots[i] = row.req.slot
            last[o : o + len(want)] = i * t + k - row.outputs + np.asarray(want)
            o += len(want)
        # Copied up to a sequence bucket: a static-shape backend sees few copy shapes, and the
        # positions past the prefix are the row's to write (or never attended).
        copies = tuple((src, dst, runner.shape(1, 1, n)[2]) for src, dst, n in self.copies)
        prefill = self.kind in ("prefill", "refresh")
        return Pass(tokens, pos, slots, last, kv_len, prefill=prefill, copies=copies)


def sample_batch(
    draws: Sequence[Draw | None], answers: Answers, *, rows: int, words: int
) -> SampleBatch:
    """The sampler's input for `rows` logits rows: `draws[i]` names logits row i (None: a row
    whose token is ignored, sampled as a padding row), each with its mask row from `answers`."""
    # Rows past the m-th stay uninitialised: their `dest` is n, so scatter_mask_rows drops them.
    compact = np.empty((rows, words), dtype=np.int32)
    dest = np.full(rows, rows, dtype=np.int64)
    ban_eos = np.zeros(rows, dtype=bool)
    params = SamplingRows([])
    m = 0
    for i, draw in enumerate(draws):
        if draw is None:
            params.rows.append(PAD_ROW)
            continue
        req, j, c = draw
        # A draft position (j > 0) has no extras: requests with penalties or logprobs never
        # draft.
        params.rows.append(_sampled_row(params, req, c) if j == 0 else _draft_row(req, c))
        out = answers.get(req)
        if out is not None and out.mask is not None:
            compact[m] = out.mask[j]
            dest[m] = i
            m += 1
        ban_eos[i] = req.sampling.ignore_eos and req.grammar is None
    return SampleBatch(compact, dest, ban_eos, params)


def _draft_row(req: Request, c: int) -> SamplingRow:
    s = req.sampling
    return SamplingRow(s.temperature, s.top_p, s.top_k, s.seed, req.sampled + c)


def _sampled_row(params: SamplingRows, req: Request, c: int) -> SamplingRow:
    """A request's sampled position, with its penalties and logprobs (and the penalty table's
    updates, added to `params`)."""
    s = req.sampling
    params.any_logprobs = params.any_logprobs or s.logprobs
    row = SamplingRow(
        s.temperature, s.top_p, s.top_k, s.seed, req.sampled + c, raw_logprobs=s.raw_logprobs
    )
    if not s.penalized:
        return row
    params.any_penalty = True
    if req.sampled == 0:  # the request's first sample: its table row starts over
        params.reset.append((req.slot, req.prompt))
    # Output tokens since the last penalised sample (sampled and forced).
    params.count.extend((req.slot, t) for t in req.output[req.counted :])
    req.counted = len(req.output)
    return replace(
        row,
        presence=s.presence_penalty,
        frequency=s.frequency_penalty,
        repetition=s.repetition_penalty,
        logit_bias=s.logit_bias,
        slot=req.slot,
    )
