"""Weights and config from a Hugging Face checkpoint directory (`config.json` + `*.safetensors`),
and the reverse: write canonical weights out as such a directory (tests and benchmarks use it to
run the same model through both loaders)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from neuron_worker.model.config import ModelConfig, ModelLoadError, config_from_hf

# HF name (after `model.layers.{i}.`) -> canonical name (after `layers.{i}.`).
_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_PREFIX = "model.layers."


def _canonical_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith(_PREFIX):
        idx, rest = name[len(_PREFIX) :].split(".", 1)
        if rest in _LAYER_NAMES:
            return f"layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


def _hf_name(canonical: str) -> str:
    for hf, can in _GLOBAL_NAMES.items():
        if can == canonical:
            return hf
    _, idx, rest = canonical.split(".", 2)
    for hf, can in _LAYER_NAMES.items():
        if can == rest:
            return f"{_PREFIX}{idx}.{hf}"
    raise KeyError(canonical)


def load_hf(path: Path, name: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a HF checkpoint directory: (config, canonical weights on CPU in the stored dtype)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (only safetensors is supported)")
    try:
        cfg: dict[str, Any] = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON ({e})") from e
    config = config_from_hf(cfg, name)
    tensors: dict[str, Tensor] = {}
    for f in files:
        try:
            loaded = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from e
        for key, value in loaded.items():
            canonical = _canonical_name(key)
            if canonical is not None:
                tensors[canonical] = value
    if "tok_embeddings.weight" not in tensors:
        raise ModelLoadError(f"{path}: no model.embed_tokens.weight in the safetensors files")
    if "output.weight" not in tensors and not config.tie_embeddings:
        config = dataclasses.replace(
            config, tie_embeddings=True
        )  # no head stored: it is the embedding
    if config.tie_embeddings:
        tensors.pop("output.weight", None)
    return config, tensors


def save_hf(
    out_dir: Path,
    config: ModelConfig,
    weights: Mapping[str, Tensor],
    *,
    tokenizer_json: str | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
) -> None:
    """Write canonical weights (`load_gguf`/`load_hf` output) as a HF checkpoint directory.

    The result loads with `load_model(out_dir)` and with transformers' `from_pretrained`.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if config.qkv_bias else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if config.rope_freq_factors is not None:
        raise ModelLoadError("save_hf: rope_freq_factors cannot be expressed in config.json")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    tensors = {
        _hf_name(k): v.contiguous()
        for k, v in weights.items()
        if not (config.tie_embeddings and k == "output.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (out_dir / "tokenizer.json").write_text(tokenizer_json)
    if tokenizer_config is not None:
        (out_dir / "tokenizer_config.json").write_text(json.dumps(dict(tokenizer_config), indent=2))
