"""One rank's device work: a forward pass of its model shard and a sampling step over its logits
slice. :class:`RankRunner` runs them locally; :class:`~neuron_worker.parallel.followers.Leader`
broadcasts each to the followers first. The decode loop and the followers take either."""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_worker.model.llama import Transformer
from neuron_worker.parallel.sampling import ShardedSampler
from neuron_worker.parallel.vocab import shard_mask_words
from neuron_worker.sampler import SamplingTensors

__all__ = ["RankRunner"]


class RankRunner:
    """A sharded model (``setup_caches`` done) and the sampler of the same rank."""

    def __init__(self, model: Transformer, sampler: ShardedSampler) -> None:
        self.model = model
        self.sampler = sampler
        self.device = model.tok_embeddings.weight.device

    @property
    def max_seq(self) -> int:
        return self.model.max_seq

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, input_pos: Tensor, cache_slots: Tensor, last: Tensor, kv_len: int
    ) -> Tensor:
        """``Transformer.step_logits``: this rank's logits slice of each row's token ``last``."""
        m = self.model
        dev = self.device
        return m.step_logits(
            tokens.to(dev),
            input_pos.to(dev),
            cache_slots.to(dev),
            m.kv_positions(kv_len),
            last.to(dev),
        )

    @torch.inference_mode()
    def sample(self, logits: Tensor, packed_mask: Tensor | None, params: SamplingTensors) -> Tensor:
        """The sharded sampler over this rank's ``logits``; ``packed_mask``: full-vocabulary
        int32 rows ``[B, W]`` (the rank applies its words) or None. Returns int64 ``[B]``."""
        words = None if packed_mask is None else shard_mask_words(packed_mask, self.sampler.shard)
        return self.sampler(logits, None if words is None else words.to(self.device), params)
