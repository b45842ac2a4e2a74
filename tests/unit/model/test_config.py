"""ModelConfig from config.json in both the transformers 4 and 5 spellings."""

from __future__ import annotations

import pytest

from neuron_worker.model.config import ModelConfig, ModelLoadError, config_from_hf

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 8192,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def test_old_and_new_rope_keys_agree() -> None:
    old = config_from_hf(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}, "m"
    )
    new = config_from_hf(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}, "m"
    )
    assert old == new
    assert old.rope_theta == 500000.0
    factors = old.rope_freq_factors
    assert factors is not None and len(factors) == 8
    assert factors[0] == 1.0 and factors[-1] == 8.0  # high frequencies kept, low ones scaled


def test_mistral_sliding_window_caps_context() -> None:
    cfg = config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096}, "m")
    assert cfg.max_seq_len == 4096
    assert (
        config_from_hf({**BASE, "model_type": "mistral", "sliding_window": None}, "m").max_seq_len
        == 8192
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model_type": "gpt2"},
        {"attention_bias": True},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        {"num_key_value_heads": 3},
    ],
)
def test_unsupported_configs_are_clear_errors(change: dict[str, object]) -> None:
    with pytest.raises(ModelLoadError):
        config_from_hf({**BASE, **change}, "m")


def test_missing_key_is_named() -> None:
    cfg = dict(BASE)
    del cfg["intermediate_size"]
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        config_from_hf(cfg, "m")


def test_sizes() -> None:
    cfg = config_from_hf(BASE, "m")
    assert isinstance(cfg, ModelConfig)
    assert (cfg.head_dim, cfg.q_size, cfg.kv_size) == (16, 64, 32)
