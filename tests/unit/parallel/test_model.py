"""A tiny model sharded over two gloo ranks computes the full model's logits, slice by slice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from maskwire.bitmask import words_per_row
from neuron_worker.model import ModelConfig, build_model
from neuron_worker.parallel import (
    Collectives,
    ProcessGroup,
    ShardedSampler,
    SingleRank,
    shard_transformer,
)
from neuron_worker.parallel.decode import batch_generate, sample_generate
from neuron_worker.parallel.launch import run_ranks
from neuron_worker.parallel.model import split_range
from neuron_worker.parallel.runner import RankRunner
from tests.unit.model.tiny import TINY, random_weights, tiny_config

PROMPTS = torch.tensor([[5, 17, 3, 60, 8, 91], [2, 2, 40, 41, 42, 0]])
# Uneven everywhere at TP = 2: 3 KV heads (2 + 1), 6 query heads, MLP 65 (33 + 32), vocab 100
# (2 words + 2 words, the last ragged), tied head, q/k/v biases.
UNEVEN = tiny_config(
    vocab_size=100, n_heads=6, n_kv_heads=3, ffn_dim=65, tie_embeddings=True, qkv_bias=True
)


def _logits(
    config: ModelConfig, group: Collectives, *, serving: bool = False
) -> tuple[Tensor, Tensor]:
    """Prefill logits of every prompt token and one decode step's logits, on this rank's
    vocabulary slice; ``serving``: with the worker's linear kernels swapped in after sharding."""
    model = build_model(config, random_weights(config))
    shard_transformer(model, group)
    if serving:
        model.use_serving_linears()
    model.setup_caches(2, 16)
    with torch.inference_mode():
        b, t = PROMPTS.shape
        pos = torch.arange(t).expand(b, t)
        prefill = model.logits(model(PROMPTS, pos, torch.arange(b), 16))
        step = model.logits(model(torch.tensor([[7], [9]]), torch.tensor([[t], [t]]), None, 16))
    return prefill, step


# Odd token ids only: the mask keeps both ranks' slices partly open.
ODD = torch.full((1, words_per_row(UNEVEN.vocab_size)), 0xAAAAAAAA - 2**32, dtype=torch.int32)


def _on_rank(group: ProcessGroup) -> dict[str, Any]:
    """Everything the tests need from the ranks, in one spawn (starting the processes is the
    slow part)."""
    return {
        "even": _logits(TINY, group),
        "uneven": _logits(UNEVEN, group),
        "serving": _logits(UNEVEN, group, serving=True),
        "generate": _generate(group, UNEVEN),
        "batch": _batch(group),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_on_rank, 2, tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("config", [TINY, UNEVEN], ids=["even", "uneven"])
def test_sharded_logits_equal_the_full_model(
    config: ModelConfig, ranks: list[dict[str, Any]]
) -> None:
    full_prefill, full_step = _logits(config, SingleRank())
    name = "even" if config is TINY else "uneven"
    prefill = torch.cat([r[name][0] for r in ranks], dim=-1)
    step = torch.cat([r[name][1] for r in ranks], dim=-1)
    assert prefill.shape == full_prefill.shape and ranks[0][name][0].shape[-1] == 64
    torch.testing.assert_close(prefill, full_prefill, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, full_step, rtol=1e-5, atol=1e-5)


def test_serving_linears_work_on_the_shards(ranks: list[dict[str, Any]]) -> None:
    full_prefill, full_step = _logits(UNEVEN, SingleRank())
    prefill = torch.cat([r["serving"][0] for r in ranks], dim=-1)
    step = torch.cat([r["serving"][1] for r in ranks], dim=-1)
    # fp32 weights keep fp32 kernels in a ServingLinear: the same numbers as nn.Linear.
    torch.testing.assert_close(prefill, full_prefill, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, full_step, rtol=1e-5, atol=1e-5)


def test_ranges_are_contiguous_and_as_even_as_possible() -> None:
    assert [split_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [split_range(65, 3, r) for r in range(3)] == [(0, 22), (22, 44), (44, 65)]


def test_more_ranks_than_kv_heads_is_refused() -> None:
    model = build_model(TINY, random_weights(TINY))

    class Four(SingleRank):
        world = 4

    with pytest.raises(ValueError, match="KV heads"):
        shard_transformer(model, Four())


def _generate(group: Collectives, config: ModelConfig) -> list[list[int]]:
    model = build_model(config, random_weights(config))
    shard = shard_transformer(model, group)
    model.setup_caches(1, 32)
    sampler = ShardedSampler(shard=shard, vocab_size=config.vocab_size, group=group)
    runner = RankRunner(model, sampler)
    prompt = PROMPTS[0].tolist()
    return [
        sample_generate(runner, prompt, 12),
        sample_generate(runner, prompt, 12, temperature=1.0, seed=3),
        sample_generate(runner, prompt, 12, temperature=0.8, top_k=5, top_p=0.9, seed=4),
        sample_generate(runner, prompt, 12, mask=ODD),
        sample_generate(runner, prompt, 12, temperature=1.0, seed=5, mask=ODD),
    ]


def _batch(group: Collectives) -> list[list[int]]:
    """Eight rows of different prompt lengths: greedy, seeded, top-k/top-p, half of them masked
    to odd tokens."""
    model = build_model(UNEVEN, random_weights(UNEVEN))
    shard = shard_transformer(model, group)
    model.setup_caches(8, 32)
    runner = RankRunner(
        model, ShardedSampler(shard=shard, vocab_size=UNEVEN.vocab_size, group=group)
    )
    prompts = [list(range(1 + i, 4 + 2 * i)) for i in range(8)]
    mask = torch.full((8, ODD.shape[1]), -1, dtype=torch.int32)
    mask[::2] = ODD
    return batch_generate(
        runner,
        prompts,
        8,
        temperature=[0.0, 0.0, 1.0, 1.0, 0.7, 0.7, 1.2, 0.0],
        top_p=[1.0, 1.0, 1.0, 1.0, 0.9, 1.0, 0.8, 1.0],
        top_k=[0, 0, 0, 0, 0, 6, 4, 0],
        seed=list(range(8)),
        mask=mask,
    )


def test_a_batch_of_eight_equals_one_rank(ranks: list[dict[str, Any]]) -> None:
    one = _batch(SingleRank())
    assert all(t % 2 for row in one[::2] for t in row)
    assert [r["batch"] for r in ranks] == [one, one]


def test_generated_tokens_equal_one_rank_greedy_and_seeded(ranks: list[dict[str, Any]]) -> None:
    one = _generate(SingleRank(), UNEVEN)
    assert one[0] != one[1]  # sampling really sampled
    assert all(t % 2 for t in one[3] + one[4]) and one[3] != one[0]  # the mask held
    assert [r["generate"] for r in ranks] == [one, one]
