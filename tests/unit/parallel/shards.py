"""Sharded sampling with every rank simulated in one process: each shard's
:func:`local_candidates`, stacked as the all-gather would, then :func:`combine`."""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_worker.parallel import shard_mask_words, vocab_shards
from neuron_worker.parallel.sampling import combine, local_candidates
from neuron_worker.sampler import SamplingTensors


def params(
    n: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 7,
    offsets: list[int] | None = None,
) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[temperature] * n,
        top_p=[top_p] * n,
        top_k=[top_k] * n,
        seed=[seed] * n,
        offset=offsets if offsets is not None else list(range(n)),
        n_rows=n,
    )


def simulate(
    logits: Tensor,
    packed: Tensor | None,
    p: SamplingTensors,
    *,
    world: int,
    vocab_size: int,
    candidates: int = 16,
) -> Tensor:
    """Tokens a group of ``world`` ranks samples from full ``logits`` [B, L] and full packed
    mask rows (the logits dimension L is the model's vocabulary)."""
    parts = []
    for shard in vocab_shards(logits.shape[1], world):
        words = None if packed is None else shard_mask_words(packed, shard)
        parts.append(
            local_candidates(
                logits[:, shard.start : shard.stop],
                words,
                p.temperature,
                p.seed,
                p.offset,
                shard=shard,
                vocab_size=vocab_size,
                mode=p.mode,
                candidates=candidates,
            )
        )
    return combine(
        torch.stack(parts),
        p.temperature,
        p.top_p,
        p.top_k,
        p.seed,
        p.offset,
        mode=p.mode,
        candidates=candidates,
    )
