"""The compiled sampler: same tokens as the eager function, and no recompilation after warmup
whatever the mix of constrained / unconstrained and greedy / random rows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo

from neuron_worker.sampler import MODES, Sampler, SamplingTensors, sample_tokens

VOCAB, WIDTH = 1_000, 1_024  # compile time does not depend on the vocabulary size
BUCKETS = (1, 4, 8)


@pytest.fixture(scope="module")
def warmed() -> Iterator[Sampler]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = Sampler(
        vocab_size=VOCAB,
        logits_size=WIDTH,
        max_rows=16,
        device=device,
        structured_outputs=True,
        compile=True,
    )
    s.warmup(BUCKETS)
    yield s


def mixed_inputs(
    n: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, SamplingTensors]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, WIDTH, generator=g) * 2
    mask = torch.randint(-(2**31), 2**31, (n, (VOCAB + 31) // 32), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[0] = -1  # unconstrained row
    if n > 2:
        mask[2] = 0  # dead row
    params = SamplingTensors.build(
        temperature=[[1.2, 0.0, 0.7, 1.0][i % 4] for i in range(n)],
        top_p=[[1.0, 1.0, 0.9, 1.0][i % 4] for i in range(n)],
        top_k=[[20, 0, 0, 0][i % 4] for i in range(n)],
        seed=[seed * 100 + i for i in range(n)],
        offset=[i for i in range(n)],
        n_rows=n,
        device=device,
    )
    return logits.to(device), mask.to(device), params


def test_greedy_graphs_compile_once() -> None:
    """Default-suite check (the greedy graphs compile in seconds): new masks, dead rows and an
    unwarmed bucket >= 2 reuse the graphs built by the first calls."""
    s = Sampler(
        vocab_size=VOCAB,
        logits_size=WIDTH,
        max_rows=16,
        device="cpu",
        structured_outputs=True,
        compile=True,
    )
    greedy = {
        n: SamplingTensors.build(
            temperature=[0.0] * n,
            top_p=[1.0] * n,
            top_k=[0] * n,
            seed=[0] * n,
            offset=[0] * n,
            n_rows=n,
        )
        for n in (1, 4, 11)
    }
    for n in (1, 4):
        s(torch.zeros(n, WIDTH), s.all_ones_mask(n), greedy[n])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (1, 4, 11):
            logits, mask, _ = mixed_inputs(n, torch.device("cpu"), n)
            got = s(logits, mask, greedy[n])
            want = sample_tokens(
                logits, mask, *_tensors(greedy[n]), vocab_size=VOCAB, mode="greedy"
            )
            assert got.tolist() == want.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def _tensors(p: SamplingTensors) -> tuple[torch.Tensor, ...]:
    return (p.temperature, p.top_p, p.top_k, p.seed, p.offset)


@pytest.mark.slow
@pytest.mark.parametrize("n", BUCKETS)
def test_compiled_matches_eager_without_recompiling(warmed: Sampler, n: int) -> None:
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Inputs made under inference mode, as the engine makes them.
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for seed in range(3):
            logits, mask, params = mixed_inputs(n, warmed.device, seed)
            for mode in MODES:
                if mode == "greedy":
                    p = SamplingTensors.build(
                        temperature=[0.0] * n,
                        top_p=[1.0] * n,
                        top_k=[0] * n,
                        seed=[0] * n,
                        offset=[0] * n,
                        n_rows=n,
                        device=warmed.device,
                    )
                elif mode == "sample":
                    p = SamplingTensors(
                        params.temperature,
                        torch.ones_like(params.top_p),
                        torch.zeros_like(params.top_k),
                        params.seed,
                        params.offset,
                        any_filter=False,
                    )
                else:
                    p = params
                assert p.mode == mode
                got = warmed(logits, mask, p)
                want = sample_tokens(
                    logits,
                    mask,
                    p.temperature,
                    p.top_p,
                    p.top_k,
                    p.seed,
                    p.offset,
                    vocab_size=VOCAB,
                    mode=mode,
                )
                assert got.tolist() == want.tolist()
                # Every mode must also cover a batch with only unconstrained rows.
                warmed(logits, warmed.all_ones_mask(n), p)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_unwarmed_bucket_shape_is_still_served_by_the_batch_graph(warmed: Sampler) -> None:
    """Buckets >= 2 share one graph per mode: a bucket never warmed up does not compile."""
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        logits, mask, params = mixed_inputs(13, warmed.device, 9)
        out = warmed(logits, mask, params)
    assert out.shape == (13,)
