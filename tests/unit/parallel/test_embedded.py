"""The embedded SmolLM2 at TP = 2 (3 KV heads: 2 + 1; 49,152 tokens: 24,576 per rank) decodes
exactly what it decodes at TP = 1: greedy on the known prompts, and seeded sampling."""

from __future__ import annotations

from typing import Any

import pytest

from maskwire.tokenizer import Tokenizer, load_tokenizer
from neuron_worker.model import load_model
from neuron_worker.parallel import (
    Collectives,
    ProcessGroup,
    ShardedSampler,
    SingleRank,
    shard_transformer,
)
from neuron_worker.parallel.decode import sample_generate
from neuron_worker.parallel.launch import run_ranks
from neuron_worker.parallel.runner import RankRunner

RAW = "The capital of France is"
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _decode(group: Collectives) -> dict[str, list[int]]:
    tok = load_tokenizer("default")
    model = load_model("default")
    shard = shard_transformer(model, group)  # at TP = 1: the whole model, through the same code
    model.setup_caches(1, 96)
    sampler = ShardedSampler(shard=shard, vocab_size=tok.vocab_size, group=group)
    runner = RankRunner(model, sampler)
    stop = tok.eos_token_ids
    return {
        "raw": sample_generate(runner, tok.encode(RAW), 2),
        "chat": sample_generate(runner, tok.encode(CHAT), 12, stop_ids=stop),
        "sampled": sample_generate(
            runner, tok.encode(CHAT), 12, temperature=0.9, top_p=0.95, seed=11
        ),
    }


def _on_rank(group: ProcessGroup) -> dict[str, list[int]]:
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
    assert run_ranks(_on_rank, 2, tmp_path_factory.mktemp("ranks")) == [one, one]
