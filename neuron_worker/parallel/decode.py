"""A single-sequence decode loop over a (possibly sharded) model and the sharded sampler: the
reference that tests and the benchmark run on every rank of a group (the engine has its own
batched scheduler)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuron_worker.model.llama import Transformer
from neuron_worker.parallel.sampling import ShardedSampler
from neuron_worker.parallel.vocab import shard_mask_words
from neuron_worker.sampler import NO_TOKEN, SamplingTensors


@torch.inference_mode()
def sample_generate(
    model: Transformer,
    sampler: ShardedSampler,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    mask: torch.Tensor | None = None,
) -> list[int]:
    """Prefill ``prompt_ids`` into slot 0, then sample until a stop id, :data:`NO_TOKEN` or
    ``max_new_tokens`` (the stop token is included). Every rank of the sampler's group must call
    it with the same arguments; all return the same tokens. Needs ``setup_caches`` first.
    ``mask``: one full-vocabulary packed row (int32 ``[1, W]``) applied at every step; each rank
    uses its words of it."""
    device = model.tok_embeddings.weight.device
    words = None if mask is None else shard_mask_words(mask, sampler.shard).to(device)
    n = len(prompt_ids)
    if n + max_new_tokens > model.max_seq:
        raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) > {model.max_seq}")
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    tokens = torch.tensor([list(prompt_ids)], device=device)
    positions = torch.arange(n, device=device)[None]
    out: list[int] = []
    while len(out) < max_new_tokens:
        hidden = model(tokens, positions, slots, model.max_seq)
        params = SamplingTensors.build(
            temperature=[temperature],
            top_p=[top_p],
            top_k=[top_k],
            seed=[seed],
            offset=[len(out)],
            n_rows=1,
            device=device,
        )
        token = int(sampler(model.logits(hidden[:, -1]), words, params)[0])
        if token == NO_TOKEN:
            break
        out.append(token)
        if token in stop_ids:
            break
        tokens = torch.tensor([[token]], device=device)
        positions = torch.tensor([[n + len(out) - 1]], device=device)
    return out
