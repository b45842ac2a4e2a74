"""The fused decode step: a whole pass of one token per row in one C++ call
(`neuron_worker.model.fused_decode`), against the model's own `step_logits`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_worker import kernels
from neuron_worker.backends import create_backend
from neuron_worker.graphs import ForwardRunner, Pass
from neuron_worker.model import Transformer, build_model
from neuron_worker.model.fused_decode import FusedDecode, unsupported
from tests.unit.model.tiny import SERVING, random_weights, tiny_config

SLOTS = 6
needs_bf16 = pytest.mark.skipif(not kernels.bf16_available(), reason="no AVX512-BF16 kernels")
# The model dtypes the step serves, each where its kernels run, with the tolerance of a fused
# pass against eager (bf16: eager rounds each op of a chain, the step once; fp32: sum orders).
DTYPES = [
    pytest.param(torch.bfloat16, 0.03, marks=needs_bf16, id="bf16"),
    pytest.param(
        torch.float32,
        1e-4,
        marks=pytest.mark.skipif(not kernels.available(), reason="no AVX2 kernels"),
        id="fp32",
    ),
]


def serving(quantize: str, dtype: torch.dtype = torch.bfloat16, **changes: object) -> Transformer:
    config = tiny_config(**{**vars(SERVING), **changes})
    model = build_model(config, random_weights(config), dtype=dtype)
    model.use_serving_linears(quantize)
    model.setup_caches(SLOTS, 64)
    return model


def fill_context(model: Transformer, length: int, seed: int = 0) -> None:
    """`length` random tokens in every slot (eager, one token per row), each slot its own."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for p in range(length):
            tokens = torch.randint(0, model.config.vocab_size, (SLOTS, 1), generator=g)
            pos = torch.full((SLOTS, 1), p)
            model.step_logits(
                tokens, pos, torch.arange(SLOTS), torch.arange(64), torch.arange(SLOTS)
            )


def a_pass(model: Transformer) -> tuple[torch.Tensor, ...]:
    """Rows in shuffled slots at different positions; row 2 is padding (position -1, slot 5)."""
    tokens = torch.tensor([[5], [17], [0], [99], [64]])
    pos = torch.tensor([[12], [3], [-1], [0], [12]])
    slots = torch.tensor([3, 1, 5, 0, 4])
    return tokens, pos, slots, torch.arange(64), torch.tensor([4, 0, 1, 3])


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
@pytest.mark.parametrize(
    ("quantize", "changes"),
    [("int4", {}), ("int8", {}), ("none", {}), ("int4", {"qkv_bias": True}), ("int4a8", {})],
    ids=["int4", "int8", "dense", "int4-qkv-bias", "int4a8"],
)
def test_a_fused_pass_is_the_models_step_and_writes_the_same_cache(
    dtype: torch.dtype, tolerance: float, quantize: str, changes: dict[str, object]
) -> None:
    eager = serving(quantize, dtype, **changes)
    fused_model = serving(quantize, dtype, **changes)
    for m in (eager, fused_model):
        fill_context(m, 13)
    fused = FusedDecode(fused_model)
    args = a_pass(eager)
    with torch.inference_mode():
        want = eager.step_logits(*args)
        got = fused(*args)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # The same kernels; the elementwise chains round once where eager rounds per op.
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    written = (torch.tensor([3, 1, 0, 4]), torch.tensor([12, 3, 0, 12]))  # (slot, position)
    for a, b in zip(eager.kv_caches(), fused_model.kv_caches(), strict=True):
        for mine, theirs in ((b.k_cache, a.k_cache), (b.v_cache, a.v_cache)):
            # what the pass wrote: RoPE'd keys round once here, twice in eager
            new, old = mine[written[0], :, written[1]], theirs[written[0], :, written[1]]
            scale = float(old.abs().max())
            torch.testing.assert_close(new.float(), old.float(), rtol=0, atol=2 * tolerance * scale)
            # and nothing else in the cache moved (padding wrote only past the end)
            mine[written[0], :, written[1]] = theirs[written[0], :, written[1]]
            assert torch.equal(mine[:, :, :64], theirs[:, :, :64])


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_a_rows_logits_do_not_depend_on_what_shares_its_pass(
    dtype: torch.dtype, tolerance: float
) -> None:
    model = serving("int4", dtype)
    fill_context(model, 9)
    fused = FusedDecode(model)
    kv = torch.arange(64)
    with torch.inference_mode():
        alone = fused(
            torch.tensor([[7], [0]]),
            torch.tensor([[9], [-1]]),
            torch.tensor([2, 5]),
            kv,
            torch.tensor([0]),
        )
        tokens = torch.tensor([[3], [7], [11], [1], [2]])
        pos = torch.tensor([[9], [9], [9], [4], [-1]])
        shared = fused(tokens, pos, torch.tensor([0, 2, 1, 3, 5]), kv, torch.arange(5))
    assert torch.equal(alone[0], shared[1])


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_the_runner_serves_decode_passes_fused_and_follows_new_caches(
    dtype: torch.dtype, tolerance: float
) -> None:
    model = serving("int4", dtype)
    runner = ForwardRunner(
        model, create_backend("cpu"), max_rows=4, max_seq=64, pad_slot=4, fused_decode=True
    )
    decode = Pass(
        tokens=np.array([[5], [9]]),
        positions=np.array([[0], [0]]),
        slots=np.array([0, 1]),
        last=np.array([0, 1]),
        kv_len=64,
    )
    first = runner.run(decode)
    step = runner._fused
    assert step is not None
    runner.run(decode)
    assert runner._fused is step  # built once, not per pass
    model.setup_caches(SLOTS, 64)  # new (zeroed) caches: the step must write into these
    again = runner.run(decode)
    assert torch.equal(first, again)
    assert model.kv_caches()[0].k_cache[:2, :, 0].abs().sum() > 0
    with torch.inference_mode():
        want = model.step_logits(
            torch.tensor([[5], [9]]),
            torch.tensor([[0], [0]]),
            torch.tensor([0, 1]),
            torch.arange(64),
            torch.arange(2),
        )
    assert torch.equal(first.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_bad_passes_are_refused_and_a_freed_step_is_gone(
    dtype: torch.dtype, tolerance: float
) -> None:
    model = serving("int4", dtype)
    fused = FusedDecode(model)
    kv = torch.arange(64)
    ok = (torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([0]), kv, torch.tensor([0]))
    with torch.inference_mode():
        fused(*ok)
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            fused(torch.tensor([[128]]), *ok[1:])
        with pytest.raises(RuntimeError, match="slot 6 out of range"):
            fused(ok[0], ok[1], torch.tensor([6]), kv, ok[4])
        with pytest.raises(RuntimeError, match="past kv_len"):
            fused(ok[0], torch.tensor([[40]]), ok[2], kv[:32], ok[4])
        with pytest.raises(RuntimeError, match="last: row 1 out of range"):
            fused(*ok[:4], torch.tensor([1]))
        handle, run = fused.handle, fused._run  # the dtype's own op (fp32: the AVX2 build's)
        fused.close()
        flat = [t.reshape(-1) for t in ok[:3]]
        with pytest.raises(RuntimeError, match=f"no decode step model {handle}"):
            run(handle, *flat, ok[4], 64)


@pytest.mark.skipif(not kernels.available(), reason="no AVX2 kernels")
def test_models_it_cannot_serve_say_why() -> None:
    half = build_model(SERVING, random_weights(SERVING), dtype=torch.float16)
    half.setup_caches(2, 64)
    assert unsupported(half) == "runs bf16 and fp32 models on a CPU only"
    plain = build_model(SERVING, random_weights(SERVING))
    plain.setup_caches(2, 64)
    assert unsupported(plain) == "attention does not read the cache in place"
    sharded = serving("int4", torch.float32)
    sharded.layers[1].feed_forward.reduce = lambda y: y  # as `neuron_worker.parallel` sets it
    assert unsupported(sharded) == "a tensor-parallel model"
    no_cache = build_model(SERVING, random_weights(SERVING))
    no_cache.use_serving_linears("int4")
    assert unsupported(no_cache) == "no KV cache yet (setup_caches)"
    with pytest.raises(ValueError, match="no fused decode step"):
        FusedDecode(no_cache)


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_trailing_padding_rows_cost_nothing_and_keep_the_logits_shape(
    dtype: torch.dtype, tolerance: float
) -> None:
    """A one-row decode padded to two rows (the graphs' shapes) runs one row: the real row's
    logits are those of the row alone, and the pass still returns a logits row per `last`."""
    model = serving("int4", dtype)
    fill_context(model, 5)
    runner = ForwardRunner(
        model, create_backend("cpu"), max_rows=4, max_seq=64, pad_slot=4, fused_decode=True
    )
    padded = Pass(
        tokens=np.array([[7], [0]]),
        positions=np.array([[5], [-1]]),
        slots=np.array([2, 4]),
        last=np.array([0, 1]),
        kv_len=64,
    )
    got = runner.run(padded)
    assert got.shape == (2, model.config.vocab_size)
    fused = runner._fused
    assert fused is not None
    with torch.inference_mode():
        alone = fused(
            torch.tensor([[7]]),
            torch.tensor([[5]]),
            torch.tensor([2]),
            torch.arange(64),
            torch.tensor([0]),
        )
    assert torch.equal(got[0], alone[0])
    # the padding row wrote nothing: the pad slot's scratch position is untouched
    assert model.kv_caches()[0].k_cache[4, :, 64].abs().sum() == 0
