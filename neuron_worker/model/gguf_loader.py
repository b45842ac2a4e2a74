"""Weights and config from a GGUF file (llama.cpp format), dequantized with the `gguf` package.

GGUF lists tensor dimensions fastest-first; `gguf.quants.dequantize` already returns them in torch
(row-major) order. llama.cpp stores Q and K of `llama`-architecture files permuted for its
adjacent-pair RoPE; we undo that here so the model only knows the Hugging Face rotate-half layout.
`qwen2` files are stored unpermuted (NEOX RoPE) and carry q/k/v biases.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch
from torch import Tensor

from maskwire.gguf_file import GGUFFile
from neuron_worker.model.config import ModelConfig, ModelLoadError, config_from_gguf
from neuron_worker.model.linear import ExactWeight, Int4Weight, Int8Weight

# GGUF tensor name (after `blk.{i}.`) -> canonical name (after `layers.{i}.`).
_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


def unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of llama.cpp's `permute`: adjacent-pair rows per head -> rotate-half rows."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )


def _canonical_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


def load_gguf(path: Path, name: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a GGUF file: (config, canonical fp32 weights on CPU)."""
    try:
        gf = GGUFFile(path)
    except (ValueError, OSError, KeyError, struct.error) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e

    tensors: dict[str, Tensor] = {}
    rope_freqs: Tensor | None = None
    for t in gf.tensors.values():
        canonical = _canonical_name(t.name)
        if canonical is None and t.name != "rope_freqs.weight":
            continue
        try:
            tensor = torch.from_numpy(t.dequantize())
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from e
        if canonical is None:
            rope_freqs = tensor.flatten()
        else:
            tensors[canonical] = tensor

    if "tok_embeddings.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    config = config_from_gguf(
        gf.metadata,
        name,
        vocab_size=int(tensors["tok_embeddings.weight"].shape[0]),
        tie_embeddings="output.weight" not in tensors,
        rope_freq_factors=None if rope_freqs is None else tuple(rope_freqs.tolist()),
    )
    if gf.metadata.get("general.architecture") == "llama":
        for i in range(config.n_layers):
            for key, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                full = f"layers.{i}.attention.{key}.weight"
                if full in tensors:
                    tensors[full] = unpermute_rope(tensors[full], heads)
    return config, tensors


def gguf_quantized_weights(path: Path, config: ModelConfig) -> dict[str, ExactWeight]:
    """The Q4_1 and Q8_0 tensors of a GGUF file as stored (canonical names, Q/K rows unpermuted
    like the float weights): the exact source of `--quantize`'s weights. Other tensors are not
    listed."""
    gf = GGUFFile(path)
    out: dict[str, ExactWeight] = {}
    for t in gf.tensors.values():
        canonical = _canonical_name(t.name)
        if canonical is None:
            continue
        if (q4 := t.q4_1_blocks()) is not None:
            q, scale, low = (torch.from_numpy(a) for a in q4)
            out[canonical] = Int4Weight(q, scale, low)
        elif (q8 := t.q8_0_blocks()) is not None:
            out[canonical] = Int8Weight(torch.from_numpy(q8[0]), torch.from_numpy(q8[1]))
    if gf.metadata.get("general.architecture") == "llama":
        for name, w in list(out.items()):
            for key, heads in (
                (".attention.wq.", config.n_heads),
                (".attention.wk.", config.n_kv_heads),
            ):
                if key in name:
                    order = unpermute_rope(torch.arange(w.q.shape[0]).unsqueeze(1), heads)
                    out[name] = w.rows(order.squeeze(1))
    return out
