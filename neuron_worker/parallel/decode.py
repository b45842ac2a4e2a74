"""A single-sequence decode loop over one rank's :class:`RankRunner` (or rank 0's ``Leader``):
the reference that tests and the benchmark run on every rank of a group (the engine has its own
batched scheduler)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuron_worker.parallel.runner import RankRunner
from neuron_worker.sampler import NO_TOKEN, SamplingTensors

__all__ = ["batch_generate", "sample_generate"]


def sample_generate(
    runner: RankRunner,
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
    ``max_new_tokens`` (the stop token is included). With plain runners every rank of the group
    calls it with the same arguments (with a ``Leader``, rank 0 alone: the followers replay);
    all get the same tokens. ``mask``: one full-vocabulary packed row (int32 ``[1, W]``) applied
    at every step."""
    n = len(prompt_ids)
    if n + max_new_tokens > runner.max_seq:
        raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) > {runner.max_seq}")
    slots = torch.zeros(1, dtype=torch.int64)
    tokens = torch.tensor([list(prompt_ids)])
    positions = torch.arange(n)[None]
    out: list[int] = []
    while len(out) < max_new_tokens:
        last = torch.tensor([tokens.shape[1] - 1])
        logits = runner.forward(tokens, positions, slots, last, runner.max_seq)
        params = SamplingTensors.build(
            temperature=[temperature],
            top_p=[top_p],
            top_k=[top_k],
            seed=[seed],
            offset=[len(out)],
            n_rows=1,
            device=runner.device,
        )
        token = int(runner.sample(logits, mask, params)[0])
        if token == NO_TOKEN:
            break
        out.append(token)
        if token in stop_ids:
            break
        tokens = torch.tensor([[token]])
        positions = torch.tensor([[n + len(out) - 1]])
    return out


def batch_generate(
    runner: RankRunner,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    seed: Sequence[int],
    mask: torch.Tensor | None = None,
) -> list[list[int]]:
    """Continuous batching in miniature: prompts of different lengths prefilled together (row i in
    slot i, padding positions ``-1``), then ``steps`` decode steps for every row, each row with its
    own sampling parameters; ``mask``: full-vocabulary packed rows ``[B, W]`` applied at every
    step. Returns each row's tokens. Raises ``ValueError`` when a row has no allowed token."""
    b = len(prompts)
    width = max(len(p) for p in prompts)
    if width + steps > runner.max_seq:
        raise ValueError(f"prompt ({width}) + steps ({steps}) > {runner.max_seq}")
    tokens = torch.zeros(b, width, dtype=torch.int64)
    positions = torch.full((b, width), -1, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(list(p))
        positions[i, : len(p)] = torch.arange(len(p))
    lengths = torch.tensor([len(p) for p in prompts])
    slots = torch.arange(b)
    last = lengths - 1
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        logits = runner.forward(tokens, positions, slots, last, runner.max_seq)
        params = SamplingTensors.build(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            offset=[step] * b,
            n_rows=b,
            device=runner.device,
        )
        sampled = runner.sample(logits, mask, params).cpu()
        if (sampled == NO_TOKEN).any():
            raise ValueError(
                f"no allowed token for rows {(sampled == NO_TOKEN).nonzero().tolist()}"
            )
        for i, t in enumerate(sampled.tolist()):
            out[i].append(t)
        tokens = sampled.unsqueeze(1)
        positions = (lengths + step).unsqueeze(1)
        last = torch.arange(b)
    return out
