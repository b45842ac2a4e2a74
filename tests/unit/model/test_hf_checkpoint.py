"""The embedded model written as a Hugging Face checkpoint directory loads back identically, and
transformers reads the directory as the same model (checks the exported Q/K layout too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from maskwire.tokenizer import load_tokenizer
from neuron_worker.model import Transformer, export_hf_checkpoint, load_model

IDS = [504, 3575, 282, 4649, 314, 198, 1, 42]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf_checkpoint("default", tmp_path_factory.mktemp("ckpt") / "smollm2-hf")


@torch.inference_mode()
def logits_of(model: Transformer) -> torch.Tensor:
    model.setup_caches(1, 16)
    n = len(IDS)
    hidden = model(torch.tensor([IDS]), torch.arange(n)[None], torch.tensor([0]), 16)
    return model.logits(hidden[0])


def test_directory_layout(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_loads_same_logits(checkpoint: Path, smollm: Transformer) -> None:
    model = load_model(str(checkpoint))
    assert model.config.name == "smollm2-hf"
    assert model.config.tie_embeddings
    assert model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(logits_of(model), logits_of(smollm), atol=1e-5, rtol=0)


def test_same_tokenizer_and_chat_template(checkpoint: Path) -> None:
    exported, embedded = load_tokenizer(str(checkpoint)), load_tokenizer("default")
    assert exported.fingerprint == embedded.fingerprint
    assert exported.chat_template == embedded.chat_template
    assert exported.encode("Hello 123 world") == embedded.encode("Hello 123 world")


def test_transformers_reads_the_export(checkpoint: Path, smollm: Transformer) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32
    )
    with torch.inference_mode():
        expected = reference(torch.tensor([IDS])).logits[0]
    assert (logits_of(smollm) - expected).abs().max() < 1e-3


def test_bad_specs_are_clear_errors(tmp_path: Path) -> None:
    from neuron_worker.model import ModelLoadError

    with pytest.raises(ModelLoadError, match="no such model"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(bad))
