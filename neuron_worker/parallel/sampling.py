"""Masked sampling over a vocabulary split across ranks, without gathering the logits.

Each rank holds the logits of its :class:`~neuron_worker.parallel.vocab.VocabShard` and its words
of the packed grammar mask. A step is two pure, static-shape halves around one ``all_gather``:

1. :func:`local_candidates` (per rank): unpack and apply the rank's mask words, then per row
   the masked maximum and its global id (greedy), the rank's best score and column of
   :func:`~neuron_worker.sampler.block_draw` (temperature sampling), and in ``"filter"`` mode the
   rank's top ``candidates`` logits with their ids plus the log of the rank's softmax mass
   (top-k / top-p). Packed into one float64 ``[B, C]`` tensor.
2. ``group.all_gather`` of those ``[B, C]`` tensors: ``world * B * C * 8`` bytes, with
   ``C = 2`` (greedy), ``4`` (sampling) or ``5 + 2 * candidates`` (top-k / top-p), never
   ``O(B * vocab)``.
3. :func:`combine` (identical on every rank): the best rank's pair per row; for top-k / top-p, the
   global top of the gathered candidates, filtered, and Gumbel-max among those kept.

The draws are the single-device sampler's (:func:`neuron_worker.sampler.sample_tokens`): its
random numbers are hashes of ``(seed, offset)`` and a global block or column id
(:func:`~neuron_worker.sampler.keyed_uniform`), so a rank draws those of its own columns only,
and the same seed picks the same token at any TP size whenever the logits are the same. Top-k and
top-p act on the best ``candidates`` tokens of the full row: ``top_k`` is capped there, and a
nucleus wider than that is cut at it (the single-device sampler keeps it whole). Masked columns,
columns past the tokenizer's vocabulary and NaN logits are ``-inf`` and never win, so an
all-masked shard never wins; a row with nothing allowed on any rank gives
:data:`~neuron_worker.sampler.NO_TOKEN`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from neuron_worker.masks import unpack_mask
from neuron_worker.parallel.group import Collectives
from neuron_worker.parallel.vocab import VocabShard
from neuron_worker.sampler import (
    COLUMN_STREAM,
    NO_TOKEN,
    Mode,
    SamplingTensors,
    block_draw,
    gumbel,
)

__all__ = [
    "ShardedSampler",
    "combine",
    "local_candidates",
    "sample_sharded",
]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Layout:
    """Columns of the packed per-rank tensor."""

    mode: Mode
    candidates: int

    @property
    def size(self) -> int:
        if self.mode == "greedy":
            return 2
        if self.mode == "sample":
            return 4
        return 5 + 2 * self.candidates


def local_candidates(
    logits: Tensor,
    mask_words: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    offset: Tensor,
    *,
    shard: VocabShard,
    vocab_size: int,
    mode: Mode,
    candidates: int,
) -> Tensor:
    """One rank's contribution, float64 ``[B, C]`` (see the module docstring).

    ``logits``: float ``[B, shard.width]``; ``mask_words``: int32 ``[B, shard.words]`` (from
    :func:`~neuron_worker.parallel.vocab.shard_mask_words`) or None; ``temperature``, ``seed``,
    ``offset``: ``[B]``. ``vocab_size`` is the tokenizer's: columns at or past it are masked.
    """
    width = shard.width
    columns = torch.arange(shard.start, shard.stop, device=logits.device)
    allowed = (columns < vocab_size).unsqueeze(0)
    if mask_words is not None:
        allowed = allowed & unpack_mask(mask_words, width)
    x = logits.float()
    x = torch.where(allowed & ~x.isnan(), x, _NEG_INF)
    best, where = x.max(dim=-1)
    parts = [best.double(), (where + shard.start).double()]
    if mode != "greedy":
        t = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
        scaled = x / t
        score, column = block_draw(scaled, seed, offset, shard.word_start)
        parts += [score.double(), (column + shard.start).double()]
        if mode == "filter":
            k = min(candidates, width)
            values, index = x.topk(k, dim=-1)
            if k < candidates:
                pad = candidates - k
                values = torch.nn.functional.pad(values, (0, pad), value=_NEG_INF)
                index = torch.nn.functional.pad(index, (0, pad), value=0)
            parts += [torch.logsumexp(scaled, dim=-1).double()]
            packed = [p.unsqueeze(1) for p in parts]
            packed += [values.double(), (index + shard.start).double()]
            return torch.cat(packed, dim=1)
    return torch.stack(parts, dim=1)


def _best(values: Tensor, ids: Tensor) -> Tensor:
    """values, ids: ``[world, B]`` -> the id of the first rank holding the row maximum, or
    NO_TOKEN where the maximum is ``-inf``."""
    rank = values.argmax(dim=0, keepdim=True)
    token = ids.gather(0, rank).squeeze(0).long()
    top = values.gather(0, rank).squeeze(0)
    return torch.where(top > _NEG_INF, token, NO_TOKEN)


def combine(
    gathered: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seed: Tensor,
    offset: Tensor,
    *,
    mode: Mode,
    candidates: int,
) -> Tensor:
    """Every rank's ``[world, B, C]`` contributions -> int64 ``[B]`` tokens (the same on every
    rank). Rows with ``temperature == 0`` are greedy; top-k / top-p apply in ``"filter"`` mode."""
    tokens = _best(gathered[:, :, 0], gathered[:, :, 1])
    if mode == "greedy":
        return tokens
    sampled = _best(gathered[:, :, 2], gathered[:, :, 3])
    if mode == "filter":
        filtered = _filtered(gathered, temperature, top_p, top_k, seed, offset, candidates)
        use = (top_k > 0) | (top_p < 1)
        sampled = torch.where(use, filtered, sampled)
    return torch.where(temperature > 0, sampled, tokens)


def _filtered(
    gathered: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seed: Tensor,
    offset: Tensor,
    candidates: int,
) -> Tensor:
    """Gumbel-max among the global top candidates that survive top-k and top-p."""
    world, b, _ = gathered.shape
    k = candidates
    values = gathered[:, :, 5 : 5 + k].permute(1, 0, 2).reshape(b, world * k)
    ids = gathered[:, :, 5 + k :].permute(1, 0, 2).reshape(b, world * k)
    # By value, then by id (as the single-device sampler sorts its row): both sorts stable.
    ids, order = ids.sort(dim=-1, stable=True)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    values, ids = values[:, :k], ids.gather(1, order)[:, :k].long()
    t = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1).double()
    total = torch.logsumexp(gathered[:, :, 4], dim=0).unsqueeze(1)  # log of the row's mass
    prob = torch.exp(values / t - total)
    pos = torch.arange(k, device=gathered.device).unsqueeze(0)
    keep_k = pos < torch.where(top_k > 0, top_k.clamp(max=k), k).unsqueeze(1)
    # Top-p keeps the smallest prefix reaching p: a candidate stays while the mass before it is
    # below p; the best one always stays.
    keep_p = (prob.cumsum(dim=-1) - prob) < top_p.unsqueeze(1).double()
    keep = ((keep_k & keep_p) | (pos == 0)) & (values > _NEG_INF)
    z = (values.float() / t.float()) + gumbel(seed, offset, ids, COLUMN_STREAM)
    z = torch.where(keep, z.double(), _NEG_INF)
    j = z.argmax(dim=-1, keepdim=True)
    token = ids.gather(1, j).squeeze(1)
    return torch.where(z.gather(1, j).squeeze(1) > _NEG_INF, token, NO_TOKEN)


def sample_sharded(
    logits: Tensor,
    mask_words: Tensor | None,
    params: SamplingTensors,
    *,
    shard: VocabShard,
    vocab_size: int,
    group: Collectives,
    candidates: int = 64,
) -> Tensor:
    """One sampling step on this rank: :func:`local_candidates`, one all-gather, :func:`combine`.
    Every rank of ``group`` must call it with its own shard; all return the same int64 ``[B]``."""
    mode = params.mode
    mine = local_candidates(
        logits,
        mask_words,
        params.temperature,
        params.seed,
        params.offset,
        shard=shard,
        vocab_size=vocab_size,
        mode=mode,
        candidates=candidates,
    )
    gathered = group.all_gather(mine)
    return combine(
        gathered,
        params.temperature,
        params.top_p,
        params.top_k,
        params.seed,
        params.offset,
        mode=mode,
        candidates=candidates,
    )


class ShardedSampler:
    """:func:`sample_sharded` bound to one rank's shard and group (eager; the two halves are
    pure and static-shape, so each can be compiled on its own around the collective)."""

    def __init__(
        self, *, shard: VocabShard, vocab_size: int, group: Collectives, candidates: int = 64
    ) -> None:
        if candidates < 1:
            raise ValueError("candidates must be >= 1")
        self.shard = shard
        self.vocab_size = vocab_size
        self.group = group
        self.candidates = candidates

    def bytes_per_step(self, rows: int, mode: Mode) -> int:
        """Bytes this rank sends to the all-gather for ``rows`` rows."""
        return rows * _Layout(mode, self.candidates).size * 8

    @torch.inference_mode()
    def __call__(
        self, logits: Tensor, mask_words: Tensor | None, params: SamplingTensors
    ) -> Tensor:
        return sample_sharded(
            logits,
            mask_words,
            params,
            shard=self.shard,
            vocab_size=self.vocab_size,
            group=self.group,
            candidates=self.candidates,
        )
