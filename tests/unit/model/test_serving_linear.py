"""The worker's serving linear layers: the packed bf16 kernel, weight-only int4/int8 for decode
passes, and quantized weights taken exactly from the embedded model's GGUF (Q4_1 layers, the
Q8_0 embedding that is also its LM head)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from maskwire.tokenizer import load_tokenizer, resolve_spec
from neuron_worker import kernels
from neuron_worker.backends import create_backend
from neuron_worker.graphs import ForwardRunner, Pass
from neuron_worker.model import Transformer, build_model, linear
from neuron_worker.model.gguf_loader import gguf_quantized_weights, load_gguf
from neuron_worker.model.linear import (
    GROUP,
    Int4Weight,
    Int8Weight,
    ServingLinear,
    can_pack,
    project,
)
from neuron_worker.model.loader import load_model
from tests.unit.model.tiny import SERVING, TINY, random_weights, serving_tiny

BF16 = {"rtol": 2e-2, "atol": 2e-2}
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nGive me a JSON object describing a cat.<|im_end|>\n<|im_start|>assistant\n",
]


def weight(n: int = 96, k: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.2


def test_int4_round_trip_is_within_half_a_step_of_each_group() -> None:
    w = weight()
    q = Int4Weight.from_float(w)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15
    err = (q.dequantize() - w).abs().reshape(96, 64 // GROUP, GROUP)
    assert bool((err <= q.scale.unsqueeze(-1) / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Weight.from_float(torch.zeros(4, 40))


@pytest.mark.skipif(not can_pack(weight().bfloat16()), reason="no oneDNN bf16 on this CPU")
def test_packed_bf16_matches_a_plain_linear() -> None:
    w, b = weight().bfloat16(), torch.randn(96).bfloat16()
    layer = ServingLinear(w, b)
    assert layer.handle is not None
    x = torch.randn(3, 5, 64).bfloat16()
    torch.testing.assert_close(layer(x), nn.functional.linear(x, w, b), **BF16)


def test_a_bf16_layer_builds_on_a_cpu_without_native_bf16_too() -> None:
    # oneDNN's bf16 reorder raises on an AVX2-only CPU: such a layer must run unpacked, not
    # stop the worker from loading (`--dtype bfloat16` there crashed the worker at start).
    w = weight().bfloat16()
    layer = ServingLinear(w, None, quantize="int4")
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (layer.handle is not None) == (native and torch.backends.mkldnn.is_available())
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(layer(x), nn.functional.linear(x, w), **BF16)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_generated_tokens_take_the_quantized_weight_and_prompts_the_dense_one(scheme: str) -> None:
    w = weight().bfloat16()
    layer = ServingLinear(w, None, quantize=scheme)
    if scheme == "int4":
        quantized = Int4Weight.from_float(w).dequantize().bfloat16()
    elif layer.kernel == "own-bf16":  # Q8_0: a scale per group of 32
        quantized = Int8Weight.from_float(w).dequantize().bfloat16()
    else:  # aten's: a scale per output channel
        scales = w.float().abs().amax(1, keepdim=True) / 127
        quantized = ((w.float() / scales).round().clamp(-128, 127) * scales).bfloat16()
    # the role decides, whatever the pass's shape: one token per row, many rows, several tokens
    for x in (torch.randn(4, 1, 64), torch.randn(40, 1, 64), torch.randn(2, 3, 64)):
        x = x.bfloat16()
        want_q, want_dense = nn.functional.linear(x, quantized), nn.functional.linear(x, w)
        torch.testing.assert_close(project(layer, x, quantized=True), want_q, **BF16)
        torch.testing.assert_close(project(layer, x, quantized=False), want_dense, **BF16)
        # the two weights differ, so the checks above tell the paths apart
        assert not torch.allclose(want_q, want_dense, atol=1e-3)
    # a plain nn.Linear has one form
    plain = nn.Linear(64, 96, bias=False)
    x = torch.randn(3, 1, 64)
    assert torch.equal(project(plain, x, quantized=True), plain(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_a_rows_result_does_not_depend_on_the_other_rows(scheme: str, dtype: torch.dtype) -> None:
    """What makes greedy output independent of batching: row i of a pass of n rows is bitwise
    row i of any other pass that holds it, through the quantized weight and through the dense one
    where it is packed (fp32 always: MKL's unpacked sgemm changes paths with the row count)."""
    layer = ServingLinear(weight().to(dtype), torch.randn(96).to(dtype), quantize=scheme)
    x = torch.randn(70, 1, 64).to(dtype)
    assert layer.handle is not None or dtype == torch.bfloat16
    for quantized in [True] if layer.handle is None else [True, False]:
        whole = project(layer, x, quantized=quantized)
        for n in (1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 16, 33):
            assert torch.equal(project(layer, x[:n], quantized=quantized), whole[:n]), n


@pytest.mark.skipif(not kernels.bf16_available(), reason="no AVX512-BF16 + VNNI kernels here")
def test_int4a8_layers_take_the_q4_1_weights_times_8_bit_activations() -> None:
    """The same Q4_1 weights as int4 with each row's activations rounded to 8 bits: close to the
    bf16-activation path but not it, one row's result independent of the pass."""
    w = weight().bfloat16()
    layer = ServingLinear(w, None, quantize="int4a8")
    x = torch.randn(40, 1, 64).bfloat16()
    got = project(layer, x, quantized=True).float()
    bf16 = project(ServingLinear(w, None, quantize="int4"), x, quantized=True).float()
    assert 0 < float((got - bf16).norm() / bf16.norm()) < 0.02
    for n in (1, 3, 8, 9, 33):
        assert torch.equal(project(layer, x[:n], quantized=True).float(), got[:n]), n


@pytest.mark.skipif(not kernels.available(), reason="no AVX2 kernels here")
def test_fp32_int4a8_layers_take_the_avx2_8_bit_activation_kernel() -> None:
    """fp32 layers run int4a8 through the AVX2 kernel: the Q4_1 weights as int4 takes them, the
    activations rounded to 8 bits (close to the fp32 path, not it), a row's result independent
    of the pass; where no kernel of the worker's runs the layer, it is refused."""
    w = weight()
    layer = ServingLinear(w, None, quantize="int4a8")
    assert layer.kernel == "own-f32"
    x = torch.randn(40, 1, 64)
    got = project(layer, x, quantized=True)
    fp32 = project(ServingLinear(w, None, quantize="int4"), x, quantized=True)
    assert 0 < float((got - fp32).norm() / fp32.norm()) < 0.02
    for n in (1, 3, 7, 8, 9, 33):
        assert torch.equal(project(layer, x[:n], quantized=True), got[:n]), n
    with pytest.raises(ValueError, match="int4a8"):
        ServingLinear(w.double(), None, quantize="int4a8")


@pytest.mark.slow  # the fallback where the worker's kernels cannot build; a compile of its own
def test_aten_int4_runs_in_a_compiled_graph_of_many_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the worker's kernel, int4 layers run aten's op, behind a custom op: inductor's own
    lowering of it inside the per-layer compile region hands the group size over as a tensor,
    which the op refuses at run time ("group size must be a scalar", torch 2.13)."""
    monkeypatch.setattr(linear, "kernel_for", lambda weight, quantize: "aten")
    config = SERVING
    m = serving_tiny("int4", in_place=False)
    m.setup_caches(5, 64)
    torch._dynamo.reset()
    kw: dict[str, Any] = {"max_rows": 4, "max_seq": 64, "pad_slot": 4, "flat_tokens": 16}
    compiled = ForwardRunner(m, create_backend("cpu", compile=True), **kw)
    eager = ForwardRunner(m, create_backend("cpu"), **kw)
    n = 12  # a flat pass of generated tokens: more rows than a batch
    p = Pass(
        np.arange(n).reshape(-1, 1) % config.vocab_size,
        np.arange(n).reshape(-1, 1),
        np.zeros(n, np.int64),
        np.array([n - 1, 5]),
        64,
    )
    with torch.inference_mode():
        got, want = compiled.run(p), eager.run(p)
    # bf16: inductor's fused norms round differently from eager ones
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_embedded_models_int4_weights_are_its_q4_1_tensors_as_stored() -> None:
    path = resolve_spec("default")
    config, floats = load_gguf(path, "default")
    exact = gguf_quantized_weights(path, config)
    name = "layers.0.attention.wq.weight"  # Q rows are permuted back like the float weights
    assert {name, "layers.0.feed_forward.w2.weight"} <= exact.keys()
    for key in (name, "layers.3.feed_forward.w2.weight", "tok_embeddings.weight"):
        torch.testing.assert_close(exact[key].dequantize(), floats[key].float(), rtol=0, atol=1e-6)
    assert isinstance(exact[name], Int4Weight)
    assert isinstance(exact["tok_embeddings.weight"], Int8Weight)  # the tied LM head: Q8_0


def greedy(model: Transformer, prompt: str, steps: int) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy tokens after `prompt` (the prompt through `prefill_logits`, each token
    through `step_logits`, as the worker runs them) and the logits they were chosen from."""
    ids = load_tokenizer("default").encode(prompt)
    n = len(ids)
    slot, kv = torch.tensor([0]), torch.arange(n + steps)
    model.setup_caches(1, n + steps)
    tokens: list[int] = []
    with torch.inference_mode():
        logits = [
            model.prefill_logits(
                torch.tensor([ids]), torch.arange(n)[None], slot, kv, torch.tensor([n - 1])
            )
        ]
        for pos in range(n, n + steps):
            tokens.append(int(logits[-1].argmax(-1)))
            step = (torch.tensor([[tokens[-1]]]), torch.tensor([[pos]]), slot, kv)
            logits.append(model.step_logits(*step, torch.tensor([0])))
    return tokens, torch.cat(logits[:-1])


@pytest.mark.skipif(not kernels.available(), reason="no AVX2 + FMA or no C++ compiler here")
def test_fp32_decode_through_the_quantized_kernels_is_the_dense_models_greedy_output() -> None:
    """The fp32 default where bf16 is emulated: generated tokens go through the checkpoint's own
    4- and 8-bit weights (the head too), which are exactly the dense model's weights, so only the
    order of the fp32 sums differs: the same greedy tokens, logits within float noise."""
    dense = load_model("default")
    fast = load_model("default", serving=True, quantize="int4")
    assert fast.layers[0].attention.wqkv.kernel == "own-f32"
    assert (fast.output.kernel, fast.output.quantize) == ("own-f32", "int8")
    for prompt in PROMPTS:
        (want, want_logits), (got, got_logits) = (greedy(m, prompt, 40) for m in (dense, fast))
        assert got == want, prompt
        assert float((got_logits - want_logits).abs().max()) < 1e-3


@pytest.mark.skipif(not kernels.bf16_available(), reason="no AVX512-BF16 or no C++ compiler here")
def test_bf16_decode_takes_the_checkpoints_q8_0_head_through_the_kernel() -> None:
    """The bf16 default: generated tokens' logits come from the tied head's Q8_0 quants as stored
    (half the bytes of the bf16 head a decode pass reads), exact but for the final bf16 rounding,
    where the dense bf16 head rounds every weight first; greedy output on the known prompts is
    the dense head's."""
    fast = load_model("default", serving=True, quantize="int4", dtype=torch.bfloat16)
    assert (fast.output.kernel, fast.output.quantize) == ("own-bf16", "int8")
    path = resolve_spec("default")
    head = gguf_quantized_weights(path, load_gguf(path, "default")[0])["tok_embeddings.weight"]
    assert isinstance(head, Int8Weight)
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact = hidden.double() @ head.dequantize().double().t()
    got = project(fast.output, hidden, quantized=True).double()
    dense = project(fast.output, hidden, quantized=False).double()
    torch.testing.assert_close(got, exact, rtol=2**-8, atol=1e-3)
    # both end in a bf16 rounding of the logits; the dense head's rounded weights add to it
    assert float((dense - exact).abs().mean()) > 1.5 * float((got - exact).abs().mean())
    plain = load_model("default", serving=True, quantize="int4", dtype=torch.bfloat16)
    plain.output = ServingLinear(plain.output.weight, None)  # the dense bf16 head
    for prompt in PROMPTS:
        assert greedy(fast, prompt, 40)[0] == greedy(plain, prompt, 40)[0], prompt


def test_a_serving_model_decodes_like_the_reference_model() -> None:
    """bf16 activations with int4 decode kernels stay near fp32 on the same 4-bit weights."""
    weights = {
        k: Int4Weight.from_float(w).dequantize()
        if ".attention.w" in k or "feed_forward" in k
        else w
        for k, w in random_weights(TINY).items()
    }
    ref = build_model(TINY, weights)
    fast = build_model(TINY, weights, dtype=torch.bfloat16)
    fast.use_serving_linears("int4")
    tokens = torch.tensor([[5, 7, 9, 11], [3, 2, 1, 0]])
    for m in (ref, fast):
        m.setup_caches(2, 16)
    slots, kv = torch.tensor([0, 1]), torch.arange(16)
    with torch.inference_mode():
        pos = torch.arange(4).expand(2, 4)
        for m in (ref, fast):
            m.step_logits(tokens, pos, slots, kv, torch.tensor([3, 3]))
        step = (torch.tensor([[4], [6]]), torch.tensor([[4], [4]]), slots, kv, torch.arange(2))
        want = ref.step_logits(*step)
        got = fast.step_logits(*step)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
