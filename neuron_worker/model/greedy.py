"""A single-sequence greedy loop over `Transformer`: the reference decode used by tests, benches
and debugging (the engine has its own batched scheduler)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuron_worker.model.llama import Transformer


@torch.inference_mode()
def greedy_generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    stop_ids: Sequence[int] = (),
    slot: int = 0,
) -> list[int]:
    """Prefill `prompt_ids` into cache slot `slot`, then decode greedily until a stop id or
    `max_new_tokens`. The stop token, if produced, is included. Needs `setup_caches` first."""
    device = model.tok_embeddings.weight.device
    n = len(prompt_ids)
    if n + max_new_tokens > model.max_seq:
        raise ValueError(
            f"prompt ({n}) + max_new_tokens ({max_new_tokens}) > max_seq ({model.max_seq})"
        )
    kv_len = model.max_seq
    slots = torch.tensor([slot], device=device)
    hidden = model(
        torch.tensor([list(prompt_ids)], device=device),
        torch.arange(n, device=device)[None],
        slots,
        kv_len,
    )
    out: list[int] = []
    for pos in range(n, n + max_new_tokens):
        token = int(model.logits(hidden[:, -1]).argmax(-1))
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        hidden = model(
            torch.tensor([[token]], device=device),
            torch.tensor([[pos]], device=device),
            slots,
            kv_len,
        )
    return out
