"""A whole decode pass (one token per row) in one C++ call: `kernels/decode_step.h`.

The compiled graph of a decode pass spends 1-2 ms outside its kernels on SmolLM2 with 2 cores
(custom-op dispatches and allocations in inductor's Python wrapper, and the graph's prologue
gathering every weight from the module tree), a third of a one-row pass. `FusedDecode` hands the
model's weights and KV caches to the C++ side once, and each pass is one call running the same
kernels in a C++ loop over the layers, with the compiled graph's rounding (the C++ header's
comment). It serves `Transformer.step_logits` for passes of one token per row where the model is
bf16 on a CPU with the AVX512-BF16 kernels or fp32 on one with the AVX2 ones, attends in place,
runs on one device (no tensor-parallel reduction) and each projection's decode form is one the C++
side calls (the worker's 4- and 8-bit kernels for its dtype, or a oneDNN-prepacked dense weight);
`unsupported` says why not otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from neuron_worker import kernels
from neuron_worker.model.linear import ServingLinear
from neuron_worker.model.llama import Transformer, TransformerBlock

# `decode_step.h`'s projection forms, by the layer's decode scheme (the worker's own kernels).
_FORMS = {"int4": 0, "int8": 1, "int4a8": 2}
_DENSE = 3


@dataclass(frozen=True)
class _Step:
    """The C++ step of one model dtype: its ops' name prefix, the kernel (`kernel_for`'s name)
    its quantized projections must run, and whether this CPU has it."""

    ops: str
    kernel: str
    available: Callable[[], bool]


_STEPS = {
    torch.bfloat16: _Step("decode_step", "own-bf16", kernels.bf16_available),
    torch.float32: _Step("decode_step_f32", "own-f32", kernels.available),
}


class FusedDecode:
    """`Transformer.step_logits` for one-token-per-row passes, as one C++ call per pass."""

    def __init__(self, model: Transformer) -> None:
        """Gather `model`'s weights and KV caches (call `unsupported` first: this raises
        ValueError where it is not None)."""
        self.handle: int = -1  # none yet (`close` is then a no-op)
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"no fused decode step: {reason}")
        tensors: list[Tensor | None] = [
            model.tok_embeddings.weight.detach(),
            model.rope_cos,
            model.rope_sin,
            model.norm.weight.detach(),
        ]
        forms: list[int] = []

        def add(layer: nn.Module) -> None:
            assert isinstance(layer, ServingLinear)
            if layer.quantize == "none":
                forms.append(_DENSE)
                tensors.extend((layer.packed, None, layer.bias))
            else:
                forms.append(_FORMS[layer.quantize])
                tensors.extend((layer.q_weight, layer.q_scales, layer.bias))

        add(model.output)
        for block in model.layers:
            assert isinstance(block, TransformerBlock)
            attn, ffn = block.attention, block.feed_forward
            assert attn.kv_cache is not None
            tensors.extend(
                (
                    block.attention_norm.weight.detach(),
                    block.ffn_norm.weight.detach(),
                    attn.kv_cache.k_cache,
                    attn.kv_cache.v_cache,
                )
            )
            for layer in (attn.wqkv, attn.wo, ffn.w13, ffn.w2):
                add(layer)
        c = model.config
        sizes = [c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, model.max_seq]
        ops = _STEPS[model.tok_embeddings.weight.dtype].ops
        self._new, self._run, self._free = (
            getattr(torch.ops.maskwire_kernels, f"{ops}_{name}") for name in ("new", "run", "free")
        )
        self.handle = self._new(tensors, forms, sizes, c.norm_eps)
        self._cache = model.kv_caches()[0].k_cache  # `serves` checks it is still the model's

    def serves(self, model: Transformer) -> bool:
        """Whether this step still runs on `model`'s current KV caches (`setup_caches` replaces
        them)."""
        first = model.layers[0]
        assert isinstance(first, TransformerBlock) and first.attention.kv_cache is not None
        return first.attention.kv_cache.k_cache is self._cache

    def __call__(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor,
        kv_positions: Tensor,
        last: Tensor,
    ) -> Tensor:
        """`Transformer.step_logits` for tokens, input_pos int64 [rows, 1]: fp32 [len(last),
        vocab]."""
        logits: Tensor = self._run(
            self.handle,
            tokens.reshape(-1),
            input_pos.reshape(-1),
            cache_slots.contiguous(),
            last.contiguous(),
            kv_positions.shape[0],
        )
        return logits

    def close(self) -> None:
        """Release the C++ side's references to the weights and caches (idempotent)."""
        if self.handle >= 0:
            self._free(self.handle)
            self.handle = -1

    def __del__(self) -> None:
        self.close()


def unsupported(model: nn.Module) -> str | None:
    """Why `FusedDecode` cannot serve `model`'s decode passes, or None where it can."""
    if not isinstance(model, Transformer):
        return "not a maskwire Transformer"
    weight = model.tok_embeddings.weight
    step = _STEPS.get(weight.dtype)
    if weight.device.type != "cpu" or step is None:
        return "runs bf16 and fp32 models on a CPU only"
    if not step.available():
        return f"the {step.kernel} kernels are not built on this CPU"
    if model.max_seq == 0:
        return "no KV cache yet (setup_caches)"
    if not model.attends_in_place:
        return "attention does not read the cache in place"
    if not model.on_one_device:
        return "a tensor-parallel model"
    for block in model.layers:
        assert isinstance(block, TransformerBlock)
        attn, ffn = block.attention, block.feed_forward
        for layer in (attn.wqkv, attn.wo, ffn.w13, ffn.w2):
            if (why := _unsupported_projection(layer, step.kernel)) is not None:
                return why
    return _unsupported_projection(model.output, step.kernel)


def _unsupported_projection(layer: nn.Module, kernel: str) -> str | None:
    if not isinstance(layer, ServingLinear):
        return "plain nn.Linear projections (no serving linears)"
    if layer.quantize == "none":
        return None if layer.handle is not None else "a dense projection oneDNN did not prepack"
    if layer.kernel != kernel or layer.quantize not in _FORMS:
        return f"a {layer.quantize} projection on {layer.kernel}"
    return None
