"""A compiler that fails on a graph: the function is served eager, with the same results, and the
failure is logged and counted (seen on CUDA with torch 2.11's inductor, docs/benchmarks.md)."""

from __future__ import annotations

import logging

import pytest
import torch

from neuron_worker.backends import create_backend
from neuron_worker.compile_fallback import compile_or_eager, fallback_counts, retry_counts
from neuron_worker.sampler import Sampler, SamplingTensors

pytestmark = pytest.mark.eager_fallback

calls = {"backend": 0}


def broken_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
    calls["backend"] += 1
    raise TypeError("list indices must be integers or slices, not NoneType")


def fallbacks(function: str) -> float:
    return fallback_counts().get(function, 0.0)


def scaled_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(dim=-1)


def test_a_failing_backend_serves_eager_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    calls["backend"] = 0
    before = fallbacks("scaled sum")
    fn = compile_or_eager(scaled_sum, name="scaled sum", backend=broken_backend, fullgraph=True)
    x = torch.arange(12.0).reshape(3, 4)
    with caplog.at_level(logging.ERROR, logger="neuron_worker.compile_fallback"):
        assert torch.equal(fn(x), scaled_sum(x))
    assert "the compiler failed on scaled sum" in caplog.text
    assert "list indices must be integers" in caplog.text
    assert fallbacks("scaled sum") == before + 1
    # Eager from then on: the compiler is not asked again, for this shape or another.
    assert torch.equal(fn(x[:2]), scaled_sum(x[:2]))
    assert calls["backend"] == 1 and fallbacks("scaled sum") == before + 1


def retries(function: str) -> float:
    return retry_counts().get(function, 0.0)


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 3, dim=-1)


def test_inductor_failing_on_a_setting_compiles_again_with_the_safer_ones(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Torch 2.11's inductor crashed in persistent reductions on CUDA: the function is compiled
    again with them off, and stays compiled (no eager fallback)."""
    import torch._inductor.config as inductor
    import torch._inductor.graph as graph

    codegen = graph.GraphLowering.codegen
    seen: list[bool] = []

    def codegen_that_fails_in_persistent_reductions(self: object) -> object:
        seen.append(inductor.triton.persistent_reductions)
        if inductor.triton.persistent_reductions:
            raise TypeError("list indices must be integers or slices, not NoneType")
        return codegen(self)  # type: ignore[arg-type]

    monkeypatch.setattr(graph.GraphLowering, "codegen", codegen_that_fails_in_persistent_reductions)
    torch._dynamo.reset()
    before = retries("row softmax"), fallbacks("row softmax")
    fn = compile_or_eager(row_softmax, name="row softmax", fullgraph=True)
    x = torch.randn(3, 40)
    with (
        inductor.patch(fx_graph_cache=False),
        caplog.at_level(logging.WARNING, logger="neuron_worker.compile_fallback"),
    ):
        assert torch.allclose(fn(x), row_softmax(x))
        assert torch.allclose(fn(x[:2]), row_softmax(x[:2]))  # a new shape: compiled again
    assert seen[0] and len(seen) >= 2 and not any(seen[1:])  # the safer settings stay
    assert "the compiler failed on row softmax; compiling it again with" in caplog.text
    assert "persistent_reductions" in caplog.text and "serving it eager" not in caplog.text
    assert (retries("row softmax"), fallbacks("row softmax")) == (before[0] + 1, before[1])
    assert inductor.triton.persistent_reductions  # only that function's compiles changed


def test_a_working_backend_is_used_and_nothing_is_counted() -> None:
    before = fallbacks("eager backend")
    fn = compile_or_eager(scaled_sum, name="eager backend", backend="eager", fullgraph=True)
    x = torch.ones(2, 3)
    assert torch.equal(fn(x), scaled_sum(x))
    assert fallbacks("eager backend") == before


def test_errors_of_the_function_itself_are_raised() -> None:
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(5, 5)  # shapes do not match

    fn = compile_or_eager(bad, name="bad", backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match=r"shape|size"):
        fn(torch.ones(2, 3))
    assert fallbacks("bad") == 0


def test_the_backend_and_the_sampler_compile_through_the_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's compiled forward (Backend.compile) and sampler graphs both survive a
    broken compiler, with the eager results."""
    real = torch.compile

    def broken(fn: object, **options: object) -> object:
        options.pop("options", None)  # inductor's options; this backend takes none
        return real(fn, **{**options, "backend": broken_backend})  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "compile", broken)
    before = {f: fallbacks(f) for f in ("forward", "sampler greedy")}
    backend = create_backend("cpu", compile=True)
    fn = backend.compile(scaled_sum, name="forward")
    x = torch.randn(4, 8)
    assert torch.equal(fn(x), scaled_sum(x))
    assert fallbacks("forward") == before["forward"] + 1

    vocab = 64
    kw = dict(vocab_size=vocab, logits_size=vocab, max_rows=2, device="cpu")
    compiled = Sampler(**kw, structured_outputs=True, compile=True)  # type: ignore[arg-type]
    eager = Sampler(**kw, structured_outputs=True, compile=False)  # type: ignore[arg-type]
    logits = torch.randn(2, vocab)
    greedy = SamplingTensors.build(
        temperature=[0.0, 0.0], top_p=[1.0, 1.0], top_k=[0, 0], seed=[1, 2], offset=[0, 0], n_rows=2
    )
    tokens = compiled(logits, compiled.all_ones_mask(2), greedy)
    assert torch.equal(tokens, eager(logits, eager.all_ones_mask(2), greedy))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert fallbacks("sampler greedy") == before["sampler greedy"] + 1
