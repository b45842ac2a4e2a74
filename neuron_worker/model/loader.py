"""`load_model(spec)`: SPEC -> ready-to-run `Transformer` (weights on the device, in the dtype)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from maskwire.tokenizer import EMBEDDED_NAME, TokenizerLoadError, load_tokenizer, resolve_spec
from neuron_worker.model.config import ModelConfig, ModelLoadError
from neuron_worker.model.gguf_loader import gguf_quantized_weights, load_gguf
from neuron_worker.model.hf_loader import load_hf, save_hf
from neuron_worker.model.llama import Transformer


def read_checkpoint(spec: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, canonical weights on CPU) for SPEC: `default`, a .gguf file or a HF directory."""
    try:
        path = resolve_spec(spec)
    except TokenizerLoadError as e:
        raise ModelLoadError(str(e)) from e
    if path.is_dir():
        return load_hf(path, path.resolve().name)
    if path.suffix == ".gguf":
        return load_gguf(path, EMBEDDED_NAME if spec == "default" else path.stem)
    raise ModelLoadError(f"{spec!r}: expected `default`, a .gguf file or a checkpoint directory")


def build_model(
    config: ModelConfig,
    weights: dict[str, Tensor],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A `Transformer` holding `weights` (canonical names) cast to dtype on device, in eval mode."""
    with torch.device("meta"):
        model = Transformer(config)
    model.load_weights({k: v.to(device=device, dtype=dtype) for k, v in weights.items()})
    model.rope_cos = torch.empty(0, device=device, dtype=dtype)
    model.rope_sin = torch.empty(0, device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    serving: bool = False,
    quantize: str = "none",
    decode_rows: Sequence[int] = (1,),
) -> Transformer:
    """SPEC: 'default' (embedded SmolLM2 GGUF), a .gguf path, or a HF checkpoint dir.

    `serving`: the worker's linear kernels (`Transformer.use_serving_linears`: prepacked bf16
    on CPU; with `quantize`, weight-only kernels for the passes over generated tokens; a GGUF's
    Q4_1 and Q8_0 weights are used exactly as stored). `quantize` "auto": each kind of
    projection takes the kernel that `neuron_worker.kernel_choice` times fastest on this host at
    the widths `decode_rows`. Off: plain `nn.Linear`s, the reference the tests compare with
    transformers."""
    config, weights = read_checkpoint(spec)
    model = build_model(config, weights, device=device, dtype=dtype)
    if serving:
        sources = None
        if quantize != "none":
            path = resolve_spec(spec)
            if path.suffix == ".gguf":
                sources = gguf_quantized_weights(path, config)
        schemes: str | Mapping[str, str] = quantize
        if quantize == "auto":
            from neuron_worker.kernel_choice import choose  # it imports this package

            schemes = choose(model, sources or {}, decode_rows).schemes
        model.use_serving_linears(schemes, sources)
    return model


def export_hf_checkpoint(spec: str, out_dir: Path) -> Path:
    """Write SPEC's weights (dequantized), tokenizer and chat template as a HF checkpoint dir."""
    config, weights = read_checkpoint(spec)
    tok = load_tokenizer(spec)
    if tok.hf is None:
        raise ModelLoadError(f"{spec!r}: tokenizer has no tokenizer.json form to export")
    tok_config = {
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token or None,
        "add_bos_token": tok.add_bos,
        "chat_template": tok.chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    save_hf(out_dir, config, weights, tokenizer_json=tok.hf.to_str(), tokenizer_config=tok_config)
    return out_dir
