"""Log-probabilities over a vocabulary split across ranks, without gathering the logits.

The sharded counterpart of :func:`neuron_worker.logprobs.token_logprobs`, in two halves around
one all-gather (:func:`local_logprob_parts` per rank, :func:`combine_logprobs` on every rank).
Each rank computes, per row, the log of its slice's softmax mass, the sampled token's
score where the token is in its slice, and its top :data:`~neuron_worker.logprobs.TOP_WIDTH`
scores with their global ids; one ``all_gather`` of those ``[B, 2 + 2 * TOP_WIDTH]`` values
(``O(batch · ranks)``) and every rank combines them: the global log-sum-exp is the log-sum-exp of
the ranks' masses, and the global top alternatives are the best of the ranks' tops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_worker.logprobs import TOP_WIDTH
from neuron_worker.masks import unpack_mask
from neuron_worker.parallel.vocab import VocabShard

__all__ = ["combine_logprobs", "local_logprob_parts"]

_NEG_INF = float("-inf")


def local_logprob_parts(
    raw: Tensor,
    processed: Tensor,
    mask_words: Tensor | None,
    temperature: Tensor,
    tokens: Tensor,
    raw_mode: Tensor,
    *,
    shard: VocabShard,
    vocab_size: int,
) -> Tensor:
    """One rank's float64 ``[B, 2 + 2K]``: log of the slice's mass, the sampled token's score
    (``-inf`` when it is another rank's), the slice's top K scores and their global ids."""
    width = shard.width
    k = min(TOP_WIDTH, vocab_size)
    columns = torch.arange(shard.start, shard.stop, device=raw.device)
    valid = (columns < vocab_size).unsqueeze(0)
    allowed = valid if mask_words is None else valid & unpack_mask(mask_words, width)
    r = torch.where(valid, raw.float(), _NEG_INF)
    p = torch.where(allowed, processed.float(), _NEG_INF)
    t = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    dist = torch.where(raw_mode.unsqueeze(1), r, p / t)
    mass = torch.logsumexp(dist, dim=-1)
    local = tokens - shard.start
    mine = (local >= 0) & (local < width)
    score = dist.gather(1, local.clamp(min=0, max=width - 1).unsqueeze(1)).squeeze(1)
    score = torch.where(mine, score, _NEG_INF)
    top, index = dist.topk(min(k, width), dim=-1)
    if top.shape[1] < k:  # a slice narrower than the alternatives wanted
        top = torch.nn.functional.pad(top, (0, k - top.shape[1]), value=_NEG_INF)
        index = torch.nn.functional.pad(index, (0, k - index.shape[1]), value=0)
    ids = (index + shard.start).to(top.dtype)
    return torch.cat([mass.unsqueeze(1), score.unsqueeze(1), top, ids], dim=1).double()


def combine_logprobs(gathered: Tensor, *, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's ``[world, B, 2 + 2k]`` parts -> ``(chosen, top_ids, top_logprobs)``."""
    world, b, _ = gathered.shape
    total = torch.logsumexp(gathered[:, :, 0], dim=0)
    chosen = gathered[:, :, 1].max(dim=0).values - total
    values = gathered[:, :, 2 : 2 + k].permute(1, 0, 2).reshape(b, world * k)
    ids = gathered[:, :, 2 + k :].permute(1, 0, 2).reshape(b, world * k)
    # Stable: equal scores keep rank order (lower ids first).
    values, order = values.sort(dim=-1, descending=True, stable=True)
    top_ids = ids.gather(1, order)[:, :k].long()
    top_lp = values[:, :k] - total.unsqueeze(1)
    return chosen.float(), top_ids, top_lp.float()
