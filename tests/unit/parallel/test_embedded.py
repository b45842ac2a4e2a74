"""The embedded SmolLM2 at TP = 2 (3 KV heads: 2 + 1; 49,152 tokens: 24,576 per rank) decodes
exactly what it decodes at TP = 1: greedy on the known prompts, and seeded sampling."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maskwire.bitmask import words_per_row
from maskwire.tokenizer import Tokenizer, load_tokenizer
from neuron_worker.model import load_model
from neuron_worker.parallel import (
    Collectives,
    ProcessGroup,
    ShardedSampler,
    SingleRank,
    shard_transformer,
)
from neuron_worker.parallel.decode import batch_generate, sample_generate
from neuron_worker.parallel.launch import run_ranks
from neuron_worker.parallel.runner import RankRunner

RAW = "The capital of France is"
BATCH = [
    RAW,
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "The opposite of hot is",
    "Paris is the capital of",
    "Once upon a time",
    '{"name": "Ada", "age":',
    "The largest planet in the solar system is",
]
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _decode(group: Collectives) -> dict[str, Any]:
    tok = load_tokenizer("default")
    model = load_model("default")
    shard = shard_transformer(model, group)  # at TP = 1: the whole model, through the same code
    model.setup_caches(8, 96)
    sampler = ShardedSampler(shard=shard, vocab_size=tok.vocab_size, group=group)
    runner = RankRunner(model, sampler)
    stop = tok.eos_token_ids
    return {
        "raw": sample_generate(runner, tok.encode(RAW), 2),
        "chat": sample_generate(runner, tok.encode(CHAT), 12, stop_ids=stop),
        "sampled": sample_generate(
            runner, tok.encode(CHAT), 12, temperature=0.9, top_p=0.95, seed=11
        ),
        # c8, greedy, the even rows masked to even token ids (a stand-in constraint that cuts
        # across both ranks' slices).
        "batch": batch_generate(
            runner,
            [tok.encode(p) for p in BATCH],
            6,
            mask=_even_rows(),
            temperature=[0.0] * 8,
            top_p=[1.0] * 8,
            top_k=[0] * 8,
            seed=[0] * 8,
        ),
    }


def _even_rows() -> torch.Tensor:
    mask = torch.full((8, words_per_row(49_152)), -1, dtype=torch.int32)
    mask[::2] = 0x55555555
    return mask


def _on_rank(group: ProcessGroup) -> dict[str, Any]:
    return _decode(group)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@pytest.mark.slow
def test_tp2_decodes_what_tp1_decodes(
    tmp_path_factory: pytest.TempPathFactory, tok: Tokenizer
) -> None:
    one: dict[str, Any] = _decode(SingleRank())  # 58 s here with the two ranks, on 2 cores
    assert tok.decode_bytes(one["raw"]) == b" Paris."
    assert tok.decode_bytes(one["chat"][:-1]) == b"The capital of France is Paris."
    assert all(t % 2 == 0 for row in one["batch"][::2] for t in row)
    assert run_ranks(_on_rank, 2, tmp_path_factory.mktemp("ranks")) == [one, one]
