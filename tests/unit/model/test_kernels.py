"""The worker's own CPU kernels (`neuron_worker.kernels`): the int4 and int8 matmuls' arithmetic
and weight layouts (bf16 and fp32 activations), decode attention against SDPA, the build cache, and the
fallback where they cannot run."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from maskwire.cpus import cpu_model_and_flags
from neuron_worker import kernels
from neuron_worker.model.linear import Int4Weight, Int8Weight, ServingLinear

needs_kernel = pytest.mark.skipif(
    not kernels.bf16_available(), reason="no AVX512-BF16 or no C++ compiler here"
)
needs_f32_kernel = pytest.mark.skipif(
    not kernels.available(), reason="no AVX2 + FMA or no C++ compiler here"
)


def test_the_kernels_build_wherever_the_cpu_and_a_compiler_allow() -> None:
    """Guards the skips below: a build that breaks fails here instead of skipping the rest."""
    chosen = kernels.cpu_kernel_set()
    if chosen is not None:
        assert kernels.available() and kernels.bf16_available() == chosen.bf16


def weight(n: int, k: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    return Int4Weight.from_float(torch.randn(n, k, generator=g) * 0.2)


def _q4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = weight(n, k)
    return w.q, w.scale, w.low


def exact(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x @ W^T in fp64 with W the Q4_1 weight as stored (scale * q + low)."""
    return x.double() @ w.dequantize().double().t()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (960, 576), (64, 1536)])
def test_the_kernel_multiplies_bf16_activations_by_q4_1_weights(rows: int, n: int, k: int) -> None:
    w = weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    got = kernels.int4_matmul(x, *kernels.pack_int4(w.q, w.scale, w.low))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # exact products, fp32 sums: only the final rounding to bf16 (8 bits) is visible
    torch.testing.assert_close(got.double(), exact(x, w), rtol=2**-8, atol=2e-3)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row's groups of 32 quantized as the 8-bit-activation kernel does, in IEEE fp32
    step by step: inv = 127 / amax, int8 values rint(x * inv) (ties to even), scale amax / 127."""
    g = x.float().reshape(x.shape[0], -1, 32).numpy()
    amax = np.abs(g).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(g * inv)
    return torch.from_numpy(
        q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)
    ).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (960, 576), (64, 1536)])
def test_the_q8_activation_kernel_multiplies_quantized_activations_by_q4_1_weights(
    rows: int, n: int, k: int
) -> None:
    """`int4_matmul_q8`: scale * (q - 8) times the row's 8-bit activations (exact int32 sums),
    plus the zero (low + 8 scale) times the exact input sums; within an activation quantization
    step of the bf16 kernel."""
    w = weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    packed = kernels.pack_int4(w.q, w.scale, w.low)
    got = kernels.int4_matmul_q8(x, *packed)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    groups = k // 32
    centred = w.q.double().reshape(n, groups, 32) - 8
    scaled_q = (centred * w.scale.double()[..., None]).reshape(n, k)
    zero = (w.low.double() + 8 * w.scale.double()).repeat_interleave(32, dim=1)
    want = q8_activations(x) @ scaled_q.t() + x.double() @ zero.t()
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2e-3)
    bf16 = kernels.int4_matmul(x, *packed).double()
    assert float((got.double() - bf16).norm() / bf16.norm()) < 0.02


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (960, 576), (64, 1536)])
def test_the_kernel_multiplies_bf16_activations_by_q8_0_weights(rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = Int8Weight.from_float(torch.randn(n, k, generator=g) * 0.2)
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = kernels.int8_matmul(x, *kernels.pack_int8(w.q, w.scale))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # the stored quants exactly (each widened to bf16 without rounding), exact products, fp32
    # sums: only the final rounding to bf16 is visible
    want = x.double() @ w.dequantize().double().t()
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_fp16_parameters_give_the_bits_of_the_same_values_in_fp32(rows: int) -> None:
    """Scales and minimums that fp16 holds exactly (a GGUF checkpoint's) are packed as fp16,
    which the bf16 kernels widen exactly: the outputs of the same values as fp32, bit for bit.
    Values fp16 cannot hold stay fp32."""
    g = torch.Generator().manual_seed(rows)
    w4 = weight(960, 576, seed=rows)
    scale, low = w4.scale.half().float(), w4.low.half().float()
    w8 = Int8Weight.from_float(torch.randn(96, 576, generator=g))
    x = torch.randn(rows, 576, generator=g).bfloat16()
    cases = [
        (kernels.int4_matmul, kernels.pack_int4(w4.q, scale, low)),
        (kernels.int4_matmul_q8, kernels.pack_int4(w4.q, scale, low)),
        (kernels.int8_matmul, kernels.pack_int8(w8.q, w8.scale.half().float())),
    ]
    for matmul, (packed, params) in cases:
        assert params.dtype == torch.float16
        assert torch.equal(matmul(x, packed, params), matmul(x, packed, params.float()))
    assert kernels.pack_int4(w4.q, w4.scale, w4.low)[1].dtype == torch.float32
    assert kernels.pack_int8(w8.q, w8.scale)[1].dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_the_weight_prefetch_distance_leaves_every_output_bit_alone(rows: int) -> None:
    """The bf16 matmuls prefetch their weights some groups ahead (a setting, 8 by default): at
    any distance, none included, and for tasks shorter than it, the outputs are the same bits."""
    g = torch.Generator().manual_seed(rows)
    w4 = weight(960, 576, seed=rows)
    w8 = Int8Weight.from_float(torch.randn(96, 576, generator=g))
    x = torch.randn(rows, 576, generator=g).bfloat16()
    cases = [
        (kernels.int4_matmul, kernels.pack_int4(w4.q, w4.scale, w4.low)),
        (kernels.int8_matmul, kernels.pack_int8(w8.q, w8.scale)),
    ]
    default = kernels.set_weight_prefetch(-1)
    assert default == 8
    try:
        outputs = []
        before = default
        for distance in (0, 1, 8, 1000):
            assert kernels.set_weight_prefetch(distance) == before
            assert kernels.set_weight_prefetch(-1) == distance
            before = distance
            outputs.append([matmul(x, *packed) for matmul, packed in cases])
    finally:
        kernels.set_weight_prefetch(default)
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            assert torch.equal(a, b)


@needs_kernel
def test_the_bf16_q8_0_kernel_refuses_mismatched_inputs() -> None:
    w = Int8Weight.from_float(torch.randn(32, 64))
    packed = kernels.pack_int8(w.q, w.scale)
    assert kernels.int8_matmul(torch.zeros(0, 64, dtype=torch.bfloat16), *packed).shape == (0, 32)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        kernels.int8_matmul(torch.zeros(2, 96, dtype=torch.bfloat16), *packed)
    with pytest.raises(RuntimeError, match="x: bf16"):
        kernels.int8_matmul(torch.zeros(2, 64), *packed)
    with pytest.raises(RuntimeError, match="w: contiguous int8"):  # the int4 layout is refused
        kernels.int8_matmul(
            torch.zeros(2, 64, dtype=torch.bfloat16), *kernels.pack_int4(*_q4(32, 64))
        )
    # the error names the shape the weight needs
    with pytest.raises(RuntimeError, match=r"scales: contiguous fp16 or fp32 \[2, 2, 16\]"):
        kernels.int8_matmul(torch.zeros(2, 64, dtype=torch.bfloat16), packed[0], packed[1][:, :1])
    with pytest.raises(ValueError, match="does not fit blocks of 16 x 32"):
        kernels.pack_int8(w.q[:24], w.scale[:24])


@needs_kernel
def test_bf16_int8_layers_take_q8_0_groups_as_stored_through_the_kernel() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 64, generator=g).bfloat16()
    q = torch.randint(-100, 101, (32, 64), dtype=torch.int8, generator=g)
    stored = Int8Weight(q, torch.rand(32, 2, generator=g) * 0.01)
    layer = ServingLinear(stored.dequantize().bfloat16(), None, quantize="int8", exact=stored)
    assert layer.kernel == "own-bf16"
    # the checkpoint's quants, not a requantization of the bf16 weight
    want = x.double() @ stored.dequantize().double().t()
    torch.testing.assert_close(layer.quantized(x).double(), want, rtol=2**-8, atol=1e-4)


@needs_f32_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(8, 32), (960, 576), (64, 1536)])
def test_the_fp32_kernel_multiplies_by_q4_1_weights_in_fp32(rows: int, n: int, k: int) -> None:
    w = weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    got = kernels.int4_matmul_f32(x, *kernels.pack_int4_f32(w.q, w.scale, w.low))
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # the stored weights exactly, fp32 arithmetic: as close as the dense fp32 matmul
    dense = x @ w.dequantize().t()
    err, dense_err = (got.double() - exact(x, w)).abs(), (dense.double() - exact(x, w)).abs()
    assert float(err.max()) <= 4 * float(dense_err.max()) + 1e-6


@needs_f32_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(8, 32), (960, 576), (64, 1536)])
def test_the_avx2_q8_activation_kernel_multiplies_quantized_activations_by_q4_1_weights(
    rows: int, n: int, k: int
) -> None:
    """`int4_matmul_q8_f32`: scale * (q - 8) times the row's 8-bit activations (exact int32
    sums), plus the zero (low + 8 scale) times the exact input sums, in fp32; within an
    activation quantization step of the fp32 kernel."""
    w = weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    got = kernels.int4_matmul_q8_f32(x, *kernels.pack_int4_q8_f32(w.q, w.scale, w.low))
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    groups = k // 32
    centred = w.q.double().reshape(n, groups, 32) - 8
    scaled_q = (centred * w.scale.double()[..., None]).reshape(n, k)
    zero = (w.low.double() + 8 * w.scale.double()).repeat_interleave(32, dim=1)
    want = q8_activations(x) @ scaled_q.t() + x.double() @ zero.t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    fp32 = kernels.int4_matmul_f32(x, *kernels.pack_int4_f32(w.q, w.scale, w.low)).double()
    assert 0 < float((got.double() - fp32).norm() / fp32.norm()) < 0.02
    with pytest.raises(RuntimeError, match=r"w: contiguous uint8"):  # the fp32 kernel's layout
        kernels.int4_matmul_q8_f32(x, *kernels.pack_int4_f32(w.q, w.scale, w.low))


# (pack, matmul) per activation dtype and scheme
KERNELS = {
    ("fp32", "int4"): (lambda w: kernels.pack_int4_f32(*_split(Int4Weight.from_float(w))),
                       kernels.int4_matmul_f32),
    ("fp32", "int8"): (lambda w: kernels.pack_int8_f32(*_split(Int8Weight.from_float(w))),
                       kernels.int8_matmul_f32),
    ("bf16", "int4"): (lambda w: kernels.pack_int4(*_split(Int4Weight.from_float(w))),
                       kernels.int4_matmul),
    ("bf16", "int8"): (lambda w: kernels.pack_int8(*_split(Int8Weight.from_float(w))),
                       kernels.int8_matmul),
    ("bf16", "int4_q8"): (lambda w: kernels.pack_int4(*_split(Int4Weight.from_float(w))),
                          kernels.int4_matmul_q8),
    ("fp32", "int4_q8"): (lambda w: kernels.pack_int4_q8_f32(*_split(Int4Weight.from_float(w))),
                          kernels.int4_matmul_q8_f32),
}  # fmt: skip


def _split(w: Int4Weight | Int8Weight) -> tuple[torch.Tensor, ...]:
    return (w.q, w.scale, w.low) if isinstance(w, Int4Weight) else (w.q, w.scale)


@pytest.mark.parametrize(
    ("activations", "scheme"),
    [
        pytest.param(*key, marks=needs_f32_kernel if key[0] == "fp32" else needs_kernel)
        for key in KERNELS
    ],
)
def test_a_kernel_rows_result_does_not_depend_on_the_rows_beside_it(
    activations: str, scheme: str
) -> None:
    """Greedy output must not depend on batching: each row sums in one order for any row count
    (19 groups, a prime: whatever number of groups a row count keeps in flight leaves some
    over)."""
    x = torch.randn(19, 608, generator=torch.Generator().manual_seed(5))
    x = x.bfloat16() if activations == "bf16" else x
    w = torch.randn(64, 608, generator=torch.Generator().manual_seed(6))
    pack, run = KERNELS[(activations, scheme)]
    packed = pack(w)
    whole = run(x, *packed)
    for rows in range(1, 19):
        assert torch.equal(run(x[:rows], *packed), whole[:rows]), rows
        assert torch.equal(run(x[rows:], *packed), whole[rows:]), rows


@needs_f32_kernel
def test_the_fp32_kernel_refuses_mismatched_inputs_and_takes_no_rows() -> None:
    w = weight(16, 64)
    packed = kernels.pack_int4_f32(w.q, w.scale, w.low)
    assert kernels.int4_matmul_f32(torch.zeros(0, 64), *packed).shape == (0, 16)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        kernels.int4_matmul_f32(torch.zeros(2, 96), *packed)
    with pytest.raises(RuntimeError, match="x: fp32"):
        kernels.int4_matmul_f32(torch.zeros(2, 64, dtype=torch.bfloat16), *packed)
    with pytest.raises(ValueError, match="does not fit blocks of 8 x 32"):
        kernels.pack_int4_f32(w.q[:12], w.scale[:12], w.low[:12])


@needs_f32_kernel
def test_the_kernels_run_on_torchs_intra_op_threads() -> None:
    """Built without OpenMP, `at::parallel_for` is a serial loop: the kernels then use one core
    whatever `torch.set_num_threads` says."""
    loaded = {
        Path(line.split()[-1])
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "maskwire_kernels-" in line
    }
    assert len(loaded) == 1
    assert b"GOMP_parallel" in loaded.pop().read_bytes()
    w = weight(3072, 576)
    packed = kernels.pack_int4_f32(w.q, w.scale, w.low)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = kernels.int4_matmul_f32(x, *packed)
        torch.set_num_threads(2)
        assert torch.equal(kernels.int4_matmul_f32(x, *packed), serial)  # each: whole blocks
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_no_rows_and_zero_activations() -> None:
    w = weight(32, 64)
    packed = kernels.pack_int4(w.q, w.scale, w.low)
    assert kernels.int4_matmul(torch.zeros(0, 64, dtype=torch.bfloat16), *packed).shape == (0, 32)
    zeros = kernels.int4_matmul(torch.zeros(3, 64, dtype=torch.bfloat16), *packed)
    assert torch.equal(zeros, torch.zeros(3, 32, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("matmul", [kernels.int4_matmul, kernels.int4_matmul_q8])
def test_the_kernel_refuses_mismatched_shapes_with_a_clear_error(matmul: Any) -> None:
    w = weight(32, 64)
    packed = kernels.pack_int4(w.q, w.scale, w.low)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        matmul(torch.zeros(2, 96, dtype=torch.bfloat16), *packed)
    with pytest.raises(RuntimeError, match="x: bf16"):
        matmul(torch.zeros(2, 64), *packed)


def test_pack_int4_needs_blocks_of_16_outputs_and_32_inputs() -> None:
    assert kernels.fits(32, 64) and not kernels.fits(40, 64) and not kernels.fits(32, 48)
    w = weight(40, 64)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.pack_int4(w.q, w.scale, w.low)


@needs_kernel
def test_serving_linears_take_the_kernel_for_generated_tokens() -> None:
    w = (torch.randn(96, 64) * 0.2).bfloat16()
    layer = ServingLinear(w, None, quantize="int4")
    assert layer.kernel == "own-bf16"
    x = torch.randn(6, 1, 64).bfloat16()
    want = exact(x.reshape(6, 64), Int4Weight.from_float(w))
    got = layer.quantized(x).reshape(6, 96).double()
    torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-3)


@needs_f32_kernel
def test_fp32_serving_linears_take_the_fp32_kernel_for_generated_tokens() -> None:
    w = torch.randn(96, 64) * 0.2
    layer = ServingLinear(w, torch.randn(96), quantize="int4")
    assert layer.kernel == "own-f32"
    x = torch.randn(6, 1, 64)
    want = exact(x.reshape(6, 64), Int4Weight.from_float(w)) + layer.bias.double()
    torch.testing.assert_close(
        layer.quantized(x).reshape(6, 96).double(), want, rtol=1e-5, atol=1e-5
    )
    assert ServingLinear(w, None, quantize="none").kernel is None
    # a shape off the kernels' blocks runs aten's kernel (int8 per channel)
    odd = torch.randn(36, 64) * 0.2
    layer = ServingLinear(odd, None, quantize="int8")
    assert layer.kernel == "aten"
    torch.testing.assert_close(
        layer.quantized(x).reshape(6, 36), x.reshape(6, 64) @ odd.t(), rtol=0.05, atol=0.05
    )


@needs_f32_kernel
def test_fp32_int8_layers_take_q8_0_groups_through_the_fp32_kernel() -> None:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(96, 64, generator=g) * 0.2
    layer = ServingLinear(w, None, quantize="int8")
    assert layer.kernel == "own-f32"
    x = torch.randn(5, 64, generator=g)
    want = x.double() @ Int8Weight.from_float(w).dequantize().double().t()
    torch.testing.assert_close(layer.quantized(x).double(), want, rtol=1e-5, atol=1e-5)
    # a checkpoint's own Q8_0 quants are taken as they are, not requantized (with |q| <= 100,
    # requantizing would rescale every group to 127 and move the weights)
    q = torch.randint(-100, 101, (16, 64), dtype=torch.int8, generator=g)
    stored = Int8Weight(q, torch.rand(16, 2, generator=g) * 0.01)
    layer = ServingLinear(stored.dequantize(), None, quantize="int8", exact=stored)
    want = x.double() @ stored.dequantize().double().t()
    torch.testing.assert_close(layer.quantized(x).double(), want, rtol=1e-5, atol=1e-5)


@needs_f32_kernel
@pytest.mark.parametrize("rows", [1, 2, 8, 11])
def test_the_fp32_kernel_multiplies_by_q8_0_weights_in_fp32(rows: int) -> None:
    w = Int8Weight.from_float(torch.randn(40, 96, generator=torch.Generator().manual_seed(rows)))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(96 + rows))
    got = kernels.int8_matmul_f32(x, *kernels.pack_int8_f32(w.q, w.scale))
    want = x.double() @ w.dequantize().double().t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"w: contiguous"):  # the int4 layout is refused
        kernels.int8_matmul_f32(x, *kernels.pack_int4_f32(*_q4(40, 96)))


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """SDPA in fp32 over each row's gathered slot, masked past each query's position."""
    tokens, length = pos.shape[1], k.shape[2]
    rows = q.shape[2]
    padding = (pos < 0) | (pos >= length)  # position 0 only
    last = pos.masked_fill(padding, 0)[:, torch.arange(rows) % tokens]  # [B, R]
    mask = torch.arange(length) <= last.unsqueeze(-1)  # [B, R, L]
    return F.scaled_dot_product_attention(
        q.double(), k[slots].double(), v[slots].double(), attn_mask=mask.unsqueeze(1)
    ).float()


def needs_attention(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not kernels.attention_available(dtype), reason=f"no decode attention for {dtype} here"
    )


ATTENTION_DTYPES = [
    pytest.param(torch.bfloat16, 2e-2, marks=needs_attention(torch.bfloat16), id="bf16"),
    pytest.param(torch.float32, 1e-5, marks=needs_attention(torch.float32), id="fp32"),
]


@pytest.mark.parametrize(("dtype", "tolerance"), ATTENTION_DTYPES)
@pytest.mark.parametrize(
    ("tokens", "group", "dim", "length"),
    [
        (1, 3, 64, 29),
        (1, 1, 32, 29),
        (3, 2, 64, 29),
        (1, 6, 128, 29),
        (2, 4, 64, 29),
        (1, 3, 64, 8),
    ],
)
def test_decode_attention_matches_sdpa_over_each_rows_slot(
    dtype: torch.dtype, tolerance: float, tokens: int, group: int, dim: int, length: int
) -> None:
    g = torch.Generator().manual_seed(tokens * 7 + dim + length)
    heads, slots_n, cache_len = 3, 6, 40
    cache = torch.randn(2, slots_n, heads, cache_len, dim, generator=g).to(dtype)
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]  # strided views, as the model passes
    slots = torch.tensor([4, 0, 5, 2])
    # row 1 is padding (-1) and row 3's 60 is past the view (padding's scratch position): both
    # attend position 0 only
    pos = torch.tensor([[10, 3, 17], [-1, -1, -1], [0, 1, 2], [28, 60, 5]])[:, :tokens]
    q = torch.randn(4, heads, group * tokens, dim, generator=g).to(dtype)
    got = kernels.decode_attention(q, k, v, slots, pos)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(
        got.float(),
        reference_attention(q, k, v, slots, pos),
        rtol=tolerance,
        atol=tolerance,
    )


@pytest.mark.parametrize(("dtype", "tolerance"), ATTENTION_DTYPES)
def test_decode_attention_refuses_bad_slots_and_shapes(
    dtype: torch.dtype, tolerance: float
) -> None:
    k = torch.zeros(2, 1, 8, 32, dtype=dtype)
    q = torch.zeros(1, 1, 1, 32, dtype=dtype)
    with pytest.raises(RuntimeError, match="slot 2 out of range"):
        kernels.decode_attention(q, k, k, torch.tensor([2]), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match=r"pos: int64 \[B, T\]"):  # no tokens: not a 0 / 0
        kernels.decode_attention(q, k, k, torch.tensor([0]), torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no positions"):
        kernels.decode_attention(
            q, k[:, :, :0], k[:, :, :0], torch.tensor([0]), torch.tensor([[0]])
        )


def test_a_second_build_reuses_the_library(tmp_path: Path) -> None:
    """The build cache on a one-function source (compiled in a second, where the kernel sets
    take ~10-25 s: those are built, or found by the same key, by the load at the top)."""
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int maskwire_probe() { return 1; }\n')
    probe = kernels.KernelSet("probe", (), (source,), (), bf16=False)
    directory = tmp_path / "kernels"
    first = kernels.build(directory, probe)
    stamp = first.stat().st_mtime_ns
    assert kernels.build(directory, probe) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in directory.iterdir()] == [first.name]  # no temporary files left
    # Another checkout of the same source finds that build; a changed source does not.
    elsewhere = tmp_path / "checkout" / "probe.cpp"
    elsewhere.parent.mkdir()
    elsewhere.write_text(source.read_text())
    again = kernels.KernelSet("probe", (), (elsewhere,), (), bf16=False)
    assert kernels.build(directory, again) == first and first.stat().st_mtime_ns == stamp
    elsewhere.write_text('extern "C" int maskwire_probe() { return 2; }\n')
    assert kernels.build(directory, again) != first


def test_without_a_working_compiler_the_worker_falls_back_to_aten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(RuntimeError, match="/bin/false exited with 1"):
        kernels.build(tmp_path / "fresh")
    assert not any((tmp_path / "fresh").iterdir())  # nothing half-written left behind
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "kernel_directory", lambda: tmp_path / "fresh")
    with caplog.at_level(logging.WARNING, logger="neuron_worker.kernels"):
        assert not kernels.available()
    if "lacks" not in caplog.text:  # on a CPU without AVX2 the flags decide first
        assert "could not build them" in caplog.text and "aten" in caplog.text
    w = torch.randn(32, 64) * 0.2
    assert ServingLinear(w, None, quantize="int4").kernel == "aten"
    assert ServingLinear(w.bfloat16(), None, quantize="int4").kernel == "aten"


def test_a_read_only_kernel_directory_builds_in_a_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tried: list[Path] = []

    def build(directory: Path, kernel_set: kernels.KernelSet) -> Path:
        tried.append(directory)
        if len(tried) == 1:
            raise PermissionError(f"{directory}: read-only file system")
        return directory / "built.so"

    monkeypatch.setattr(kernels, "build", build)
    monkeypatch.setattr(kernels, "kernel_directory", lambda: tmp_path / "volume")
    with caplog.at_level(logging.WARNING, logger="neuron_worker.kernels"):
        built = kernels._build_somewhere(kernels.KERNEL_SETS[-1])
    assert tried[0] == tmp_path / "volume" and tried[1].name.startswith("maskwire-kernels-")
    assert built == tried[1] / "built.so" and "not writable" in caplog.text
    tried[1].rmdir()


def test_the_environment_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "0")
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_loaded", None)
    assert not kernels.available()


@pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_model_and_flags()[1], reason="the CPU runs no kernel set"
)
def test_the_environment_names_the_kernel_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "avx2")
    chosen = kernels.cpu_kernel_set()
    assert chosen is not None and chosen.name == "avx2" and not chosen.bf16
    monkeypatch.setenv(kernels.KERNELS_ENV, "avx9")
    assert kernels.cpu_kernel_set() is None
    assert "MASKWIRE_KERNELS=avx9: not a kernel set" in kernels._choose()[1]


def _cpu_flags() -> frozenset[str]:
    return cpu_model_and_flags()[1]


# The fp32 kernels of a kernel set this process did not load (two sets cannot share a process:
# both register the `maskwire_kernels` ops), against fp64 references, in a process of their own
# that loads only that set's library (argv[1]).
OTHER_SET_CHECKS = """
import sys

import torch

from neuron_worker import kernels
from neuron_worker.model.linear import Int8Weight
from tests.unit.model.test_kernels import reference_attention, weight


def check(name, x, got, w):
    # As close to x @ W^T (fp64, W as stored) as the dense fp32 matmul is.
    exact = x.double() @ w.double().t()
    err = float((got.double() - exact).abs().max())
    dense_err = float(((x @ w.t()).double() - exact).abs().max())
    assert err <= 4 * dense_err + 1e-6, (name, tuple(x.shape), tuple(w.shape), err, dense_err)


torch.ops.load_library(sys.argv[1])
for rows in (1, 3, 8, 9, 17):
    for n, k in ((8, 32), (960, 576), (64, 1536)):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
        w4 = weight(n, k, seed=rows)
        got = kernels.int4_matmul_f32(x, *kernels.pack_int4_f32(w4.q, w4.scale, w4.low))
        check("int4", x, got, w4.dequantize())
        w8 = Int8Weight.from_float(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
        got = kernels.int8_matmul_f32(x, *kernels.pack_int8_f32(w8.q, w8.scale))
        check("int8", x, got, w8.dequantize())
g = torch.Generator().manual_seed(11)
cache = torch.randn(2, 6, 3, 40, 64, generator=g)
k, v = cache[0, :, :, :29], cache[1, :, :, :29]
slots = torch.tensor([4, 0, 5, 2])
pos = torch.tensor([[10, 3], [-1, -1], [0, 1], [28, 60]])
q = torch.randn(4, 3, 2 * 2, 64, generator=g)
got = kernels.decode_attention(q, k, v, slots, pos)
want = reference_attention(q, k, v, slots, pos)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("checked")
"""


# The kernel sets this CPU runs but the worker does not load here (AVX2 on an AVX-512 host).
OTHER_SETS = pytest.mark.parametrize(
    "kernel_set",
    [
        s
        for s in kernels.KERNEL_SETS
        if set(s.cpu_flags) <= _cpu_flags() and s != kernels.cpu_kernel_set()
    ],
    ids=lambda s: s.name,
)


@pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler")
@OTHER_SETS
def test_every_kernel_set_the_cpu_runs_builds_and_computes_right(
    kernel_set: kernels.KernelSet,
) -> None:
    """The worker loads the richest set the CPU runs, so the other sets (AVX2 on an AVX-512
    host) would otherwise never be built or run here: built with only their own ISA flags,
    their fp32 matmuls and attention must match the references."""
    library = kernels._build_somewhere(kernel_set)
    assert kernel_set.name in library.name
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, kernels.KERNELS_ENV: "0", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", OTHER_SET_CHECKS, str(library)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip() == "checked", done.stderr[-3000:]


@pytest.mark.slow  # ~20 s: the host's own set runs these tests in the default run
@pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler")
@OTHER_SETS
def test_every_kernel_set_the_cpu_runs_serves_fp32_models(kernel_set: kernels.KernelSet) -> None:
    """The fp32 tests of the serving linears and the fused decode step, in a process that loads
    only `kernel_set` (`MASKWIRE_KERNELS`), as a host whose richest set it is would run them."""
    root = Path(__file__).resolve().parents[3]
    tests = ("tests/unit/model/test_serving_linear.py", "tests/unit/model/test_fused_decode.py")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k", "fp32"],
        cwd=root,
        env={**os.environ, kernels.KERNELS_ENV: kernel_set.name},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"\b\d+ passed\b", done.stdout) and "skipped" not in done.stdout
