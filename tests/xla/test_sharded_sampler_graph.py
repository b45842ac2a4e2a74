"""The sharded sampler's two halves as XLA graphs for one rank shape (the ragged last slice):
tokens equal the CPU's, and new logits, masks and parameters compile nothing."""

from __future__ import annotations

import pytest
import torch
import torch_xla

from maskwire.bitmask import words_per_row
from neuron_worker.parallel import shard_mask_words, vocab_shards
from neuron_worker.parallel.sampling import combine, local_candidates
from neuron_worker.sampler import Mode, SamplingTensors
from neuron_worker.xla import compile_stats

pytestmark = pytest.mark.xla

V = 1000  # 32 words: 16 + 16 at TP = 2, the last slice 488 tokens
N = 4
K = 8
SHARDS = vocab_shards(V, 2)
CASES: list[tuple[Mode, float, float, int]] = [
    ("greedy", 0.0, 1.0, 0),
    ("sample", 0.9, 1.0, 0),
    ("filter", 0.9, 0.8, 5),
]


def _params(temperature: float, top_p: float, top_k: int, seed: int) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[temperature] * N,
        top_p=[top_p] * N,
        top_k=[top_k] * N,
        seed=[seed + i for i in range(N)],
        offset=[3] * N,
        n_rows=N,
    )


def _tokens(
    logits: torch.Tensor, packed: torch.Tensor, p: SamplingTensors, mode: Mode, dev: torch.device
) -> torch.Tensor:
    """Both ranks' local halves (their graphs), stacked as the all-gather would, then combine."""
    with torch.no_grad():
        parts = []
        for shard in SHARDS:
            parts.append(
                local_candidates(
                    logits[:, shard.start : shard.stop].to(dev),
                    shard_mask_words(packed, shard).to(dev),
                    p.temperature.to(dev),
                    p.seed.to(dev),
                    p.offset.to(dev),
                    shard=shard,
                    vocab_size=V,
                    mode=mode,
                    candidates=K,
                )
            )
            if dev.type == "xla":
                torch_xla.sync()
        out = combine(
            torch.stack(parts),
            p.temperature.to(dev),
            p.top_p.to(dev),
            p.top_k.to(dev),
            p.seed.to(dev),
            p.offset.to(dev),
            mode=mode,
            candidates=K,
        )
        if dev.type == "xla":
            torch_xla.sync()
    return out.cpu()


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 3
    packed = torch.randint(-(2**31), 2**31, (N, words_per_row(V)), generator=g).to(torch.int32)
    return logits, packed


def test_sharded_sampler_on_xla_equals_cpu_and_compiles_once() -> None:
    dev = torch_xla.device()
    cpu = torch.device("cpu")
    first = before = compile_stats()
    for step in range(3):
        if step == 2:
            before = compile_stats()
        logits, packed = _inputs(step)
        for mode, temperature, top_p, top_k in CASES:
            p = _params(temperature, top_p, top_k, seed=10 * step)
            expected = _tokens(logits, packed, p, mode, cpu)
            assert torch.equal(_tokens(logits, packed, p, mode, dev), expected), (step, mode)
    assert (before - first).compilations > 0  # the graphs really ran on XLA
    assert (compile_stats() - before).compilations == 0
