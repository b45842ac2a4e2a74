"""Weight-only quantized linear layers (`--quantize int4|int8`) for memory-bound CPU decoding.

A decode step reads every weight once for a handful of tokens, so on a CPU its time is the weight
bytes over the memory bandwidth: 4-bit weights are read 4x faster than bf16 ones. Prefill is the
opposite (hundreds of tokens per weight read: compute-bound), where the dequantizing kernels lose
to bf16 matrix engines (AMX). So a `QuantLinear` keeps both: the quantized weight for passes of
at most `small_rows` rows (decode) and the dense weight for the rest. The choice depends on the
input's shape only, which is static in every compiled graph.

int4 is groups of 32 along the input dimension with a scale and a minimum each (`w = scale * q +
min`, q in 0..15): exactly the layout of llama.cpp's Q4_1. Weights that come from a Q4_1 GGUF
(the embedded SmolLM2's linear layers) are taken as they are stored, so the 4-bit model is the
checkpoint itself; other weights are quantized per group from their min and max. int8 is one
scale per output channel (`_weight_int8pack_mm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

GROUP = 32
SCHEMES = ("none", "int4", "int8")


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


class QuantLinear(nn.Module):
    """`nn.Linear` (no bias) with a weight-only quantized kernel for inputs of few rows."""

    weight: Tensor
    bias: Tensor | None

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        scheme: str,
        small_rows: int,
        int4: Int4Weight | None = None,
    ) -> None:
        super().__init__()
        if scheme not in ("int4", "int8"):
            raise ValueError(f"unknown quantization {scheme!r}")
        self.scheme = scheme
        self.small_rows = small_rows
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        dtype = weight.dtype
        if scheme == "int4":
            source = int4 if int4 is not None else Int4Weight.from_float(weight)
            # The kernel computes (q - 8) * scale + zero: zero = low + 8 * scale.
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                source.q.to(torch.int32).contiguous(), 1
            )
            zeros = source.low + 8 * source.scale
            sz = torch.stack([source.scale.t(), zeros.t()], dim=-1).to(dtype).contiguous()
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_and_zeros", sz, persistent=False)
        else:
            w = weight.detach().float()
            scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
            q8 = (w / scales.unsqueeze(1)).round().clamp(-128, 127).to(torch.int8)
            self.register_buffer("packed", q8.contiguous(), persistent=False)
            self.register_buffer("scales_and_zeros", scales.to(dtype), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.numel() // self.in_features
        if rows > self.small_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        if self.scheme == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, GROUP, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
