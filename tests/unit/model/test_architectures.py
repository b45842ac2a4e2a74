"""Tiny random-weight Llama / Mistral / Qwen2 checkpoints against transformers' own classes, loaded
both from a HF directory and from a GGUF file written the way llama.cpp writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neuron_worker.model import Transformer, load_model

transformers = pytest.importorskip("transformers")

COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
ROPE = {"rope_type": "default", "rope_theta": 5000.0}
ARCHS: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": False, "rope_parameters": ROPE}),
    "llama3-scaled-tied": (
        transformers.LlamaConfig,
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": (
        transformers.MistralConfig,
        {"sliding_window": None, "tie_word_embeddings": False, "rope_parameters": ROPE},
    ),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": False, "rope_parameters": ROPE}),
}
IDS = [3, 77, 12, 5, 100, 64, 9, 31, 2, 118, 45, 6]


def reference_model(arch: str) -> Any:
    config_cls, extra = ARCHS[arch]
    config = config_cls(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the init's 0.02 so the comparison is meaningful
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


def write_gguf(path: Path, arch: str, model: Any) -> None:
    """A GGUF as llama.cpp's converter writes it: F32 tensors, llama Q/K permuted."""
    import gguf

    cfg = model.config
    gguf_arch = "qwen2" if cfg.model_type == "qwen2" else "llama"
    assert arch.startswith(gguf_arch)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        # llama.cpp stores Llama 3.1 scaling as per-frequency divisors in `rope_freqs.weight`.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))

    def permute(t: np.ndarray, heads: int) -> np.ndarray:
        return (
            t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:])
            .swapaxes(1, 2)
            .reshape(t.shape)
        )

    names = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        prefix = ""
        if stem.startswith("model.layers."):
            _, _, idx, stem = stem.split(".", 3)
            prefix = f"blk.{idx}."
        data = tensor.float().numpy().copy()
        if gguf_arch == "llama" and stem == "self_attn.q_proj":
            data = permute(data, cfg.num_attention_heads)
        if gguf_arch == "llama" and stem == "self_attn.k_proj":
            data = permute(data, cfg.num_key_value_heads)
        w.add_tensor(f"{prefix}{names[stem]}.{kind}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@torch.inference_mode()
def our_logits(model: Transformer) -> torch.Tensor:
    model.setup_caches(2, 32)
    n = len(IDS)
    # Prefill 8 tokens into slot 1, then the rest one token at a time.
    hidden = model(torch.tensor([IDS[:8]]), torch.arange(8)[None], torch.tensor([1]), 32)
    rows = [model.logits(hidden[0])]
    for p in range(8, n):
        hidden = model(torch.tensor([[IDS[p]]]), torch.tensor([[p]]), torch.tensor([1]), 16)
        rows.append(model.logits(hidden[0]))
    return torch.cat(rows)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_directory_matches_transformers(arch: str, tmp_path: Path) -> None:
    reference = reference_model(arch)
    reference.save_pretrained(tmp_path)
    with torch.inference_mode():
        expected = reference(torch.tensor([IDS])).logits[0]
    model = load_model(str(tmp_path))
    assert model.config.qkv_bias == (arch == "qwen2")
    assert (model.config.rope_freq_factors is not None) == (arch == "llama3-scaled-tied")
    torch.testing.assert_close(our_logits(model), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled-tied", "qwen2"])
def test_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    reference = reference_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, reference)
    with torch.inference_mode():
        expected = reference(torch.tensor([IDS])).logits[0]
    model = load_model(str(path))
    assert model.config.name == f"tiny-{arch}"
    assert model.config.qkv_bias == (arch == "qwen2")
    assert model.config.tie_embeddings == (arch == "llama3-scaled-tied")
    assert (model.config.rope_freq_factors is not None) == (arch == "llama3-scaled-tied")
    torch.testing.assert_close(our_logits(model), expected, atol=1e-4, rtol=1e-4)
