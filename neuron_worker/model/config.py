"""`ModelConfig`: the decoder's shape, read from GGUF metadata or a Hugging Face `config.json`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class ModelLoadError(ValueError):
    """The SPEC names a model we cannot load (unsupported architecture, missing tensors...)."""


# Architectures one decoder covers: Llama (SmolLM2, Llama 3, Mistral) and Qwen2 (q/k/v biases).
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. `vocab_size` is the logits dimension (embedding rows)."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    tie_embeddings: bool
    qkv_bias: bool = False
    # Per-frequency divisors of RoPE's inverse frequencies (Llama 3.1+ "llama3" scaling; GGUF
    # `rope_freqs.weight`). None = plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelLoadError("rope_freq_factors must have head_dim/2 entries")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


def config_from_hf(cfg: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a Hugging Face `config.json` (llama, mistral or qwen2)."""
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{name}: model_type {model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelLoadError(f"{name}: attention_bias/mlp_bias checkpoints are not supported")
    # transformers >= 5 nests RoPE settings in `rope_parameters`; older files use `rope_theta` and
    # `rope_scaling` at the top level.
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    try:
        dim = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or dim // n_heads)
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        max_seq = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            # Within one window sliding attention is full attention: cap the context there.
            max_seq = min(max_seq, int(window))
        return ModelConfig(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            ffn_dim=int(cfg["intermediate_size"]),
            rope_theta=theta,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=max_seq,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            rope_freq_factors=_hf_rope_factors(rope, head_dim, theta, name),
        )
    except KeyError as e:
        raise ModelLoadError(f"{name}: config.json lacks {e.args[0]!r}") from e


def _hf_rope_factors(
    scaling: dict[str, Any], head_dim: int, theta: float, name: str
) -> tuple[float, ...] | None:
    """Llama 3.1 "llama3" RoPE scaling as per-frequency divisors (as llama.cpp's `rope_freqs`)."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{name}: rope_scaling type {kind!r} is not supported (llama3 is)")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def config_from_gguf(
    fields: dict[str, Any],
    name: str,
    *,
    vocab_size: int,
    tie_embeddings: bool,
    rope_freq_factors: tuple[float, ...] | None = None,
) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{key: value}`); tensor-derived facts are passed in."""
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{name}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{name}: GGUF metadata lacks {arch}.{key}")
        return value

    dim = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    return ModelConfig(
        name=name,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", dim // n_heads)),
        ffn_dim=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(get("context_length", 4096)),
        tie_embeddings=tie_embeddings,
        qkv_bias=arch == "qwen2",
        rope_freq_factors=rope_freq_factors,
    )
