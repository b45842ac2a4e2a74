"""Tiny random-weight decoders for fast semantics tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from neuron_worker import kernels
from neuron_worker.model import ModelConfig, Transformer, build_model

TINY = ModelConfig(
    name="tiny",
    vocab_size=96,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    max_seq_len=256,
    tie_embeddings=False,
)


def tiny_config(**changes: object) -> ModelConfig:
    return dataclasses.replace(TINY, **changes)  # type: ignore[arg-type]


# Sizes the worker's CPU kernels take (head size a multiple of 16, groups of 32 inputs).
SERVING = tiny_config(dim=64, head_dim=32, vocab_size=128)


def serving_dtype() -> torch.dtype:
    """The dtype the worker serves in on this CPU: bf16 where its kernels run bf16, else fp32."""
    return torch.bfloat16 if kernels.attention_available(torch.bfloat16) else torch.float32


def serving_tiny(quantize: str, *, in_place: bool = True) -> Transformer:
    """A tiny decoder in the worker's serving configuration for this CPU: bf16 where the kernels
    run it (AVX512-BF16), else fp32, with the serving linears (`quantize`: "none", "int4");
    `in_place`: the test needs the decode attention kernel, skipped where it is not built."""
    m = build_model(SERVING, random_weights(SERVING), dtype=serving_dtype())
    m.use_serving_linears(quantize)
    if in_place and not m.attends_in_place:
        pytest.skip("the decode attention kernel is not available on this CPU")
    return m


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, Tensor]:
    """Canonical weights with enough scale that attention patterns matter."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> Tensor:
        return torch.randn(*shape, generator=g) * scale

    c = config
    w = {
        "tok_embeddings.weight": rand(c.vocab_size, c.dim, scale=1.0),
        "norm.weight": 1 + rand(c.dim, scale=0.1),
    }
    if not c.tie_embeddings:
        w["output.weight"] = rand(c.vocab_size, c.dim)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w[p + "attention_norm.weight"] = 1 + rand(c.dim, scale=0.1)
        w[p + "ffn_norm.weight"] = 1 + rand(c.dim, scale=0.1)
        w[p + "attention.wq.weight"] = rand(c.q_size, c.dim)
        w[p + "attention.wk.weight"] = rand(c.kv_size, c.dim)
        w[p + "attention.wv.weight"] = rand(c.kv_size, c.dim)
        w[p + "attention.wo.weight"] = rand(c.dim, c.q_size)
        w[p + "feed_forward.w1.weight"] = rand(c.ffn_dim, c.dim)
        w[p + "feed_forward.w3.weight"] = rand(c.ffn_dim, c.dim)
        w[p + "feed_forward.w2.weight"] = rand(c.dim, c.ffn_dim)
        if c.qkv_bias:
            w[p + "attention.wq.bias"] = rand(c.q_size)
            w[p + "attention.wk.bias"] = rand(c.kv_size)
            w[p + "attention.wv.bias"] = rand(c.kv_size)
    return w


def tiny_model(config: ModelConfig = TINY, *, max_batch: int = 4, max_seq: int = 64) -> Transformer:
    model = build_model(config, random_weights(config))
    model.setup_caches(max_batch, max_seq)
    return model
