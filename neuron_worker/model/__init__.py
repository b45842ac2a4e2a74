"""The worker's model: a Llama-family decoder (SmolLM2, Llama 3, Mistral, Qwen2) with a static KV
cache, loaded from a GGUF file or a Hugging Face checkpoint directory."""

from neuron_worker.model.config import ModelConfig, ModelLoadError
from neuron_worker.model.llama import Transformer
from neuron_worker.model.loader import (
    build_model,
    export_hf_checkpoint,
    load_model,
    read_checkpoint,
)

__all__ = [
    "ModelConfig",
    "ModelLoadError",
    "Transformer",
    "build_model",
    "export_hf_checkpoint",
    "load_model",
    "read_checkpoint",
]
