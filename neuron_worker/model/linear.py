"""Linear layers for serving on a CPU: prepacked matrix-engine weights and weight-only int4/int8.

A decode step reads every weight once for a handful of tokens, so on a CPU its time is the weight
bytes over the memory bandwidth: 4-bit weights are read 4x faster than bf16 ones. Prefill is the
opposite (hundreds of tokens per weight read: compute-bound), where dequantizing kernels lose to
bf16 matrix engines (AMX, through oneDNN). So a `ServingLinear` keeps both forms, and the pass's
role picks one: `project(layer, x, quantized=True)` for the tokens a request generates (decode,
jump-forward, draft verification), the dense weight for prompts. The role, not the pass's size,
decides, so a token gets the same weights (and the same logits, bit for bit) whatever else shares
its pass: greedy output does not depend on how requests happen to be batched.

Dense bf16 weights are prepacked once into oneDNN's blocked layout (what inductor's freezing would
do, which it cannot cache: a frozen graph is recompiled at every start). The packed weight stays
outside the graph, behind the `maskwire::packed_linear` op and an integer handle, so compiled graphs
keep the weights as ordinary inputs and load from inductor's on-disk cache.

int4 is groups of 32 along the input dimension with a scale and a minimum each (`w = scale * q +
min`, q in 0..15): exactly llama.cpp's Q4_1. Weights that come from a Q4_1 GGUF (the embedded
SmolLM2's linear layers) are taken as stored, so the 4-bit model is the checkpoint itself; other
weights are quantized per group from their min and max. int8 is one scale per output channel.
On a CPU with AVX512-BF16, int4 layers run the worker's own kernel (`neuron_worker.kernels`:
one read of the weights for up to 8 rows, exact bf16 products); elsewhere aten's, which
dequantizes per block of 4 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from neuron_worker import kernels

GROUP = 32
QUANTIZE_SCHEMES = ("none", "int4", "int8")

# Packed oneDNN weights by handle (a process-wide table: handles are plain integers in graphs).
_PACKED: list[Tensor] = []


@torch.library.custom_op("maskwire::packed_linear", mutates_args=())
def packed_linear(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    """`x @ W^T` with W the oneDNN-prepacked weight registered under `handle` (0-d int64)."""
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, shape[-1]), _PACKED[int(handle)], None, "none", [], ""
    )
    return y.reshape(*shape[:-1], out_features)


@packed_linear.register_fake
def _packed_linear_shape(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("maskwire::aten_int4_mm", mutates_args=())
def aten_int4_mm(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    """aten's int4 matmul (`x` [M, in] bf16) behind an op inductor does not lower: its lowering
    for a symbolic M that may exceed a few rows passes the group size as a tensor, which the
    kernel refuses at run time (torch 2.13)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)


@aten_int4_mm.register_fake
def _aten_int4_mm_shape(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], scales.shape[1])


def own_int4_kernel(weight: Tensor) -> bool:
    """Whether an int4 layer runs `neuron_worker.kernels` (one read of the weights for up to 8
    rows) rather than aten's kernel (blocks of 4 rows): bf16 on a CPU where it is built."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and kernels.available()


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN prepacking applies: bf16 weights on a CPU whose oneDNN has a bf16 path
    (AVX512 or AMX; on an AVX2-only CPU the reorder raises, and bf16 layers run unpacked).
    fp32 matmuls run as well through MKL unpacked."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@dataclass(frozen=True)
class Int4Weight:
    """A [N, K] weight as `scale * q + low` per group of 32 along K."""

    q: Tensor  # uint8 [N, K], 0..15
    scale: Tensor  # float32 [N, K / 32]
    low: Tensor  # float32 [N, K / 32]

    @classmethod
    def from_float(cls, w: Tensor) -> Int4Weight:
        """Quantize per group from its minimum and maximum (round to nearest)."""
        n, k = w.shape
        if k % GROUP:
            raise ValueError(f"int4 needs the input dimension ({k}) to be a multiple of {GROUP}")
        g = w.detach().float().reshape(n, k // GROUP, GROUP)
        low = g.amin(-1)
        scale = ((g.amax(-1) - low) / 15).clamp(min=1e-12)
        q = ((g - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        return cls(q.to(torch.uint8).reshape(n, k), scale, low)

    @classmethod
    def cat(cls, parts: Sequence[Int4Weight]) -> Int4Weight:
        """Row-wise concatenation (fused q/k/v, gate/up)."""
        return cls(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.low for p in parts]),
        )

    def rows(self, index: Tensor) -> Int4Weight:
        """The rows `index` in that order (llama.cpp's Q/K permutation undone)."""
        return Int4Weight(self.q[index], self.scale[index], self.low[index])

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        g = self.q.float().reshape(n, k // GROUP, GROUP)
        return (g * self.scale.unsqueeze(-1) + self.low.unsqueeze(-1)).reshape(n, k)


def _aten_int4(source: Int4Weight, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`source` in the layout of aten's `_weight_int4pack_mm_for_cpu`, which computes
    (q - 8) * scale + zero: zero = low + 8 * scale."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        source.q.to(torch.int32).contiguous(), 1
    )
    zeros = source.low + 8 * source.scale
    return packed, torch.stack([source.scale.t(), zeros.t()], dim=-1).to(dtype).contiguous()


class ServingLinear(nn.Module):
    """A linear layer (optional bias) with a dense and, with `quantize`, a weight-only quantized
    form (module docstring)."""

    weight: Tensor
    bias: Tensor | None
    handle: Tensor | None
    q_weight: Tensor
    q_scales: Tensor

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        quantize: str = "none",
        int4: Int4Weight | None = None,
        pack: bool = True,
    ) -> None:
        super().__init__()
        if quantize not in QUANTIZE_SCHEMES:
            raise ValueError(f"unknown quantization {quantize!r}")
        self.quantize = quantize
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        handle = None
        if pack and can_pack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            _PACKED.append(self.packed)
            handle = torch.tensor(len(_PACKED) - 1)
        self.register_buffer("handle", handle, persistent=False)
        self.int4_kernel = quantize == "int4" and own_int4_kernel(weight)
        if quantize == "int4":
            source = int4 if int4 is not None else Int4Weight.from_float(weight)
            if self.int4_kernel:
                packed, scales = kernels.pack_int4(source.q, source.scale, source.low)
            else:
                packed, scales = _aten_int4(source, weight.dtype)
            self.register_buffer("q_weight", packed, persistent=False)
            self.register_buffer("q_scales", scales, persistent=False)
        elif quantize == "int8":
            w = weight.detach().float()
            scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
            q8 = (w / scales.unsqueeze(1)).round().clamp(-128, 127).to(torch.int8)
            self.register_buffer("q_weight", q8.contiguous(), persistent=False)
            self.register_buffer("q_scales", scales.to(weight.dtype), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """The dense weight. x: [..., in_features]."""
        if self.handle is not None:
            if torch.compiler.is_compiling():
                y = packed_linear(x, self.handle, self.out_features)
            else:  # eager: the kernel itself, without the custom op's Python dispatch
                y = torch.ops.mkldnn._linear_pointwise(
                    x.reshape(-1, self.in_features), self.packed, None, "none", [], ""
                ).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return nn.functional.linear(x, self.weight, self.bias)

    def quantized(self, x: Tensor) -> Tensor:
        """The weight-only quantized weight (the dense one without `quantize`). Every row's
        result is independent of how many rows `x` has. x: [..., in_features]."""
        if self.quantize == "none":
            return self(x)
        y = self._quantized(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _quantized(self, x: Tensor) -> Tensor:
        if self.int4_kernel:
            return kernels.int4_matmul(x, self.q_weight, self.q_scales)
        if self.quantize == "int4":
            return aten_int4_mm(x, self.q_weight, self.q_scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.q_weight, self.q_scales)


def project(layer: nn.Module, x: Tensor, quantized: bool) -> Tensor:
    """`layer(x)`, through its weight-only quantized form when `quantized` and it has one: how the
    model calls its projections, so that the pass's role picks the weights (module docstring)."""
    if quantized and isinstance(layer, ServingLinear):
        return layer.quantized(x)
    out: Tensor = layer(x)
    return out
