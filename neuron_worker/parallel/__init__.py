"""Tensor parallelism: a Llama-family model sharded Megatron-style over a group of ranks, with a
vocab-parallel LM head, the packed grammar mask split to match, and sampling across the shards
without gathering logits.

* :mod:`~neuron_worker.parallel.vocab`: vocabulary slices on mask-word boundaries, a rank's words
  of a full packed mask.
* :mod:`~neuron_worker.parallel.group`: the collectives (all-reduce, all-gather) behind one
  interface; ``torch.distributed`` (gloo on CPU, nccl on CUDA) or a single rank.
* :mod:`~neuron_worker.parallel.model`: shard a loaded ``Transformer`` in place.
* :mod:`~neuron_worker.parallel.sampling`: the sharded masked sampler.
* :mod:`~neuron_worker.parallel.runner`, :mod:`~neuron_worker.parallel.followers`: one rank's
  forward + sample; rank 0 broadcasting them to follower ranks, which replay; a rank monitor.
* :mod:`~neuron_worker.parallel.decode`, :mod:`~neuron_worker.parallel.launch`: a reference
  decode loop and local rank processes (tests, benchmark).
"""

from neuron_worker.parallel.group import Collectives, ProcessGroup, SingleRank, init_group
from neuron_worker.parallel.model import shard_transformer
from neuron_worker.parallel.sampling import ShardedSampler, sample_sharded
from neuron_worker.parallel.vocab import VocabShard, shard_mask_words, vocab_shards

__all__ = [
    "Collectives",
    "ProcessGroup",
    "ShardedSampler",
    "SingleRank",
    "VocabShard",
    "init_group",
    "sample_sharded",
    "shard_mask_words",
    "shard_transformer",
    "vocab_shards",
]
