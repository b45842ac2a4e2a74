"""Linear layers for serving on a CPU: prepacked matrix-engine weights and weight-only int4/int8.

A decode step reads every weight once for a handful of tokens, so on a CPU its time is the weight
bytes over the memory bandwidth: 4-bit weights are read 4x faster than bf16 ones. Prefill is the
opposite (hundreds of tokens per weight read: compute-bound), where dequantizing kernels lose to
bf16 matrix engines (AMX, through oneDNN). So a `ServingLinear` keeps both forms, and the pass's
role picks one: `project(layer, x, quantized=True)` for the tokens a request generates (decode,
jump-forward, draft verification), the dense weight for prompts. The role, not the pass's size,
decides, so a token gets the same weights (and the same logits, bit for bit) whatever else shares
its pass: greedy output does not depend on how requests happen to be batched. For the same reason
the decode form is one per kind of projection for every pass, never one per pass size, when
`--quantize auto` times the forms on the host (`neuron_worker.kernel_choice`, which times them
through `DecodeForm`).

Dense weights are prepacked once into oneDNN's blocked layout (what inductor's freezing would do,
which it cannot cache: a frozen graph is recompiled at every start): bf16 where oneDNN has a bf16
path, and fp32 always, because oneDNN computes a row the same way for any row count and MKL's
unpacked sgemm does not (the same reason: a pass's size must not change a token's logits). The
packed weight stays outside the graph, behind the `maskwire::packed_linear` op and an integer
handle, so compiled graphs keep the weights as ordinary inputs and load from inductor's on-disk
cache.

int4 is groups of 32 along the input dimension with a scale and a minimum each (`w = scale * q +
min`, q in 0..15): exactly llama.cpp's Q4_1. Weights that come from a Q4_1 GGUF (the embedded
SmolLM2's linear layers) are taken as stored, so the 4-bit model is the checkpoint itself; other
weights are quantized per group from their min and max. int8 is llama.cpp's Q8_0 (a scale per
group of 32; a Q8_0 tensor, as the embedded model's embedding and tied LM head, taken as stored)
under the worker's kernels, and one scale per output channel under aten's.
int4 and int8 layers run the worker's own kernels where the CPU has them (`neuron_worker.kernels`:
one read of the weights for up to 8 rows): bf16 activations with exact products on AVX512-BF16,
fp32 activations on AVX2 (where bf16 is emulated and the worker runs fp32: the 4-bit weights are
then the checkpoint's exactly and the arithmetic fp32, only the order of the sums differs from the
dense path). Elsewhere aten's, which dequantizes per block of 4 rows. int4a8 is the same Q4_1
weights times 8-bit activations (each row's inputs quantized per group of 32, as llama.cpp does),
through the worker's VNNI kernel (bf16) or its AVX2 one (fp32, `vpmaddubsw`): integer products,
fewer instructions per weight, at the cost of rounding the activations (~1% of a projection's
output); a forced choice only (`--quantize int4a8`), never `kernel_choice`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Self

import torch
from torch import Tensor, nn

from neuron_worker import kernels

GROUP = 32
QUANTIZE_SCHEMES = ("none", "int4", "int8", "int4a8")
INT4_SCHEMES = ("int4", "int4a8")  # the Q4_1 weights, with bf16 or 8-bit activations

# Packed oneDNN weights by handle (a process-wide table: handles are plain integers in graphs).
_PACKED: list[Tensor] = []


@torch.library.custom_op("maskwire::packed_linear", mutates_args=())
def packed_linear(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    """`x @ W^T` with W the oneDNN-prepacked weight registered under `handle` (0-d int64)."""
    y = _packed_matmul(x.reshape(-1, x.shape[-1]), _PACKED[int(handle)])
    return y.reshape(*x.shape[:-1], out_features)


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


def kernel_for(weight: Tensor, quantize: str) -> str:
    """Which kernel a layer with this (dense) weight runs for its `quantize` form: `own-bf16`
    (int4 or int8 per group, bf16 activations, AVX512-BF16) or `own-f32` (the same, fp32
    activations, AVX2): `neuron_worker.kernels`' one read of the weights for up to 8 rows; else
    `aten` (int4 dequantized per block of 4 rows, its fp32 path scalar; int8 per channel), also
    for a shape that does not fit the kernels' blocks."""
    if weight.device.type == "cpu" and kernels.fits(*weight.shape):
        if weight.dtype == torch.bfloat16 and kernels.bf16_available():
            return "own-bf16"
        if weight.dtype == torch.float32 and kernels.available():
            return "own-f32"
    return "aten"


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN prepacking applies: fp32 weights, and bf16 ones on a CPU whose oneDNN has a
    bf16 path (AVX512 or AMX; on an AVX2-only CPU the reorder raises, and bf16 layers run
    unpacked). fp32 is packed for its batch invariance: MKL's unpacked sgemm takes other paths for
    1-3, 5-7 or 9-11 rows, so a row's result would depend on how many rows share its pass."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _groups(w: Tensor, scheme: str) -> Tensor:
    """`w` [N, K] as fp32 groups of 32 along K: [N, K / 32, 32]."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"{scheme} needs the input dimension ({k}) to be a multiple of {GROUP}")
    return w.detach().float().reshape(n, k // GROUP, GROUP)


@dataclass(frozen=True)
class _GroupQuants:
    """Quants [N, K] with per-group parameters [N, K / 32]: every field is indexed by row."""

    def rows(self, index: Tensor) -> Self:
        """The rows `index` in that order (llama.cpp's Q/K permutation undone)."""
        return type(self)(*(getattr(self, f.name)[index] for f in fields(self)))

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """Row-wise concatenation (fused q/k/v, gate/up)."""
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass(frozen=True)
class Int4Weight(_GroupQuants):
    """A [N, K] weight as `scale * q + low` per group of 32 along K."""

    q: Tensor  # uint8 [N, K], 0..15
    scale: Tensor  # float32 [N, K / 32]
    low: Tensor  # float32 [N, K / 32]

    @classmethod
    def from_float(cls, w: Tensor) -> Int4Weight:
        """Quantize per group from its minimum and maximum (round to nearest)."""
        g = _groups(w, "int4")
        low = g.amin(-1)
        scale = ((g.amax(-1) - low) / 15).clamp(min=1e-12)
        q = ((g - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        return cls(q.to(torch.uint8).reshape(w.shape), scale, low)

    def dequantize(self) -> Tensor:
        g = _groups(self.q, "int4")
        return (g * self.scale.unsqueeze(-1) + self.low.unsqueeze(-1)).reshape(self.q.shape)


@dataclass(frozen=True)
class Int8Weight(_GroupQuants):
    """A [N, K] weight as `scale * q` per group of 32 along K: llama.cpp's Q8_0."""

    q: Tensor  # int8 [N, K]
    scale: Tensor  # float32 [N, K / 32]

    @classmethod
    def from_float(cls, w: Tensor) -> Int8Weight:
        """Quantize per group from its largest magnitude (round to nearest)."""
        g = _groups(w, "int8")
        scale = (g.abs().amax(-1) / 127).clamp(min=1e-12)
        q = (g / scale.unsqueeze(-1)).round().clamp(-128, 127)
        return cls(q.to(torch.int8).reshape(w.shape), scale)

    def dequantize(self) -> Tensor:
        return (_groups(self.q, "int8") * self.scale.unsqueeze(-1)).reshape(self.q.shape)


ExactWeight = Int4Weight | Int8Weight


def _aten_int4(source: Int4Weight, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`source` in the layout of aten's `_weight_int4pack_mm_for_cpu`, which computes
    (q - 8) * scale + zero: zero = low + 8 * scale."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        source.q.to(torch.int32).contiguous(), 1
    )
    zeros = source.low + 8 * source.scale
    return packed, torch.stack([source.scale.t(), zeros.t()], dim=-1).to(dtype).contiguous()


def _quantized_form(
    weight: Tensor, quantize: str, kernel: str, exact: ExactWeight | None
) -> tuple[Tensor, Tensor]:
    """(packed weight, scales) of `weight`'s `quantize` form in `kernel`'s layout; `exact`: the
    checkpoint's own quants of that scheme, used as they are."""
    if quantize in INT4_SCHEMES:
        int4 = exact if isinstance(exact, Int4Weight) else Int4Weight.from_float(weight)
        if kernel == "own-bf16":
            return kernels.pack_int4(int4.q, int4.scale, int4.low)
        if kernel == "own-f32" and quantize == "int4a8":
            return kernels.pack_int4_q8_f32(int4.q, int4.scale, int4.low)
        if kernel == "own-f32":
            return kernels.pack_int4_f32(int4.q, int4.scale, int4.low)
        return _aten_int4(int4, weight.dtype)
    if kernel.startswith("own"):
        int8 = exact if isinstance(exact, Int8Weight) else Int8Weight.from_float(weight)
        if kernel == "own-bf16":
            return kernels.pack_int8(int8.q, int8.scale)
        return kernels.pack_int8_f32(int8.q, int8.scale)
    # aten: one scale per output channel
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q8 = (w / scales.unsqueeze(1)).round().clamp(-128, 127).to(torch.int8)
    return q8.contiguous(), scales.to(weight.dtype)


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
        exact: ExactWeight | None = None,
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
        self.kernel = kernel_for(weight, quantize) if quantize != "none" else None
        if quantize == "int4a8" and self.kernel not in ("own-bf16", "own-f32"):
            raise ValueError("int4a8 runs the worker's own kernels only (AVX512-VNNI or AVX2)")
        if self.kernel is not None:
            packed, scales = _quantized_form(weight, quantize, self.kernel, exact)
            self.register_buffer("q_weight", packed, persistent=False)
            self.register_buffer("q_scales", scales, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """The dense weight. x: [..., in_features]."""
        if self.handle is not None:
            if torch.compiler.is_compiling():
                y = packed_linear(x, self.handle, self.out_features)
            else:  # eager: the kernel itself, without the custom op's Python dispatch
                y = _packed_matmul(x.reshape(-1, self.in_features), self.packed)
                y = y.reshape(*x.shape[:-1], self.out_features)
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
        assert self.kernel is not None
        return _quantized_matmul(x, self.quantize, self.kernel, self.q_weight, self.q_scales)


def _packed_matmul(x: Tensor, packed: Tensor) -> Tensor:
    """`x @ W^T` for x [rows, in] and a oneDNN-prepacked W."""
    y: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return y


def _quantized_matmul(
    x: Tensor, scheme: str, kernel: str, packed: Tensor, scales: Tensor
) -> Tensor:
    """`x @ W^T` for x [rows, in] and W's `scheme` form in `kernel`'s layout (`_quantized_form`)."""
    if kernel == "own-bf16" and scheme == "int4":
        return kernels.int4_matmul(x, packed, scales)
    if kernel == "own-bf16" and scheme == "int4a8":
        return kernels.int4_matmul_q8(x, packed, scales)
    if kernel == "own-bf16":
        return kernels.int8_matmul(x, packed, scales)
    if kernel == "own-f32" and scheme == "int4":
        return kernels.int4_matmul_f32(x, packed, scales)
    if kernel == "own-f32" and scheme == "int4a8":
        return kernels.int4_matmul_q8_f32(x, packed, scales)
    if kernel == "own-f32":
        return kernels.int8_matmul_f32(x, packed, scales)
    if scheme == "int4":
        return aten_int4_mm(x, packed, scales)
    y: Tensor = torch.ops.aten._weight_int8pack_mm(x, packed, scales)
    return y


@dataclass(frozen=True)
class DecodeForm:
    """One weight's form for the decode role, outside any layer: what `ServingLinear` would run
    for its `scheme` ("none": the dense weight, prepacked where `can_pack`), to time it
    (`neuron_worker.kernel_choice`). Nothing is registered: the form goes with the object."""

    scheme: str
    kernel: str  # `kernel_for`'s name; "onednn" (prepacked) or "aten" for the dense form
    tensors: tuple[Tensor, ...]

    @classmethod
    def of(cls, weight: Tensor, scheme: str) -> DecodeForm:
        if scheme == "none":
            if can_pack(weight):
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                return cls(scheme, "onednn", (packed,))
            return cls(scheme, "aten", (weight.detach(),))
        kernel = kernel_for(weight, scheme)
        return cls(scheme, kernel, _quantized_form(weight, scheme, kernel, None))

    def __call__(self, x: Tensor) -> Tensor:
        """`x @ W^T`, x [rows, in]."""
        if self.scheme != "none":
            return _quantized_matmul(x, self.scheme, self.kernel, *self.tensors)
        if self.kernel == "onednn":
            return _packed_matmul(x, self.tensors[0])
        return nn.functional.linear(x, self.tensors[0])

    def copy(self) -> DecodeForm:
        """The same form in memory of its own (a prepacked weight too: it clones)."""
        return DecodeForm(self.scheme, self.kernel, tuple(t.clone() for t in self.tensors))

    @property
    def nbytes(self) -> int:
        """The bytes a pass reads (a prepacked weight's padding aside)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def project(layer: nn.Module, x: Tensor, quantized: bool) -> Tensor:
    """`layer(x)`, through its weight-only quantized form when `quantized` and it has one: how the
    model calls its projections, so that the pass's role picks the weights (module docstring)."""
    if quantized and isinstance(layer, ServingLinear):
        return layer.quantized(x)
    out: Tensor = layer(x)
    return out
