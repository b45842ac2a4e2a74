"""The compiled sampler: same tokens as the eager function, and no recompilation after warmup
whatever the mix of constrained / unconstrained and greedy / random rows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo

from neuron_worker.sampler import MODES, NO_TOKEN, Sampler, SamplingTensors, sample_tokens

# Compile time does not depend on the vocabulary size. VOCAB is not a multiple of 32: the last
# mask word has bits past it, and the logits have padding columns past it (WIDTH).
VOCAB, WIDTH = 1_000, 1_024
BUCKETS = (1, 4, 8)
PAD_LOGIT = 1e4  # padding columns hold the largest logits: they must still never be chosen


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
    logits[:, VOCAB:] = PAD_LOGIT
    mask = torch.randint(-(2**31), 2**31, (n, (VOCAB + 31) // 32), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[:, -1] = -1  # the bits past VOCAB are set too
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
            assert ((got >= 0) & (got < VOCAB) | (got == NO_TOKEN)).all() and got[0] >= 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_sample_and_filter_graphs_match_eager_within_the_vocab() -> None:
    """Default-suite check of the random-sampling graphs, the single-row ones (the batch graphs
    compile in the slow stage): the compiled token is the eager function's for many seeds, and
    never a column past the vocabulary although those hold the largest logits and the mask words
    cover them; the graphs do not recompile for new masks, seeds or parameters."""
    s = Sampler(
        vocab_size=VOCAB,
        logits_size=WIDTH,
        max_rows=1,
        device="cpu",
        structured_outputs=True,
        compile=True,
    )
    cpu = torch.device("cpu")
    with torch.inference_mode():
        s.warmup([1])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in range(12):
                logits, _, _ = mixed_inputs(1, cpu, seed)
                _, random_mask, _ = mixed_inputs(3, cpu, seed)  # row 1: constrained, random
                for mask in (s.all_ones_mask(1), random_mask[1:2]):
                    for mode, top_p, top_k in (
                        ("sample", 1.0, 0),
                        ("filter", 0.9, 0),
                        ("filter", 1.0, 7),
                    ):
                        p = SamplingTensors.build(
                            temperature=[0.5 + seed / 8],
                            top_p=[top_p],
                            top_k=[top_k],
                            seed=[seed],
                            offset=[3 * seed],
                            n_rows=1,
                        )
                        assert p.mode == mode
                        got = s(logits, mask, p)
                        want = sample_tokens(
                            logits, mask, *_tensors(p), vocab_size=VOCAB, mode=mode
                        )
                        assert got.tolist() == want.tolist(), (seed, mode)
                        assert 0 <= int(got[0]) < VOCAB, (seed, mode, int(got[0]))
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
                assert got[0] >= 0 and ((got < VOCAB) | (got == NO_TOKEN)).all()
                # Every mode must also cover a batch with only unconstrained rows.
                out = warmed(logits, warmed.all_ones_mask(n), p)
                assert ((out >= 0) & (out < VOCAB)).all()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_unwarmed_bucket_shape_is_still_served_by_the_batch_graph(warmed: Sampler) -> None:
    """Buckets >= 2 share one graph per mode: a bucket never warmed up does not compile."""
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        logits, mask, params = mixed_inputs(13, warmed.device, 9)
        out = warmed(logits, mask, params)
    assert out.shape == (13,)
