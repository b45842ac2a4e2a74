"""Penalties, logit bias and logprobs on the device: semantics against a float64 reference, the
grammar mask winning over any bias, the occurrence table, and compiled graphs that never
recompile for new values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo

from neuron_worker.logprobs import TOP_WIDTH, token_logprobs
from neuron_worker.penalties import (
    BIAS_WIDTH,
    OccurrenceTable,
    PenaltyTensors,
    apply_penalties,
)
from neuron_worker.sampler import Sampler, SamplingTensors, sample_tokens
from tests.unit.sampler.test_sampler import packed_from_allowed

VOCAB, WIDTH = 1_000, 1_024


def penalties(n: int, device: torch.device | str = "cpu", **kw: list[Any]) -> PenaltyTensors:
    return PenaltyTensors.build(
        presence=kw.get("presence", [0.0] * n),
        frequency=kw.get("frequency", [0.0] * n),
        repetition=kw.get("repetition", [1.0] * n),
        logit_bias=kw.get("logit_bias", [{}] * n),
        n_rows=n,
        device=device,
    )


def greedy(n: int, temperature: float = 0.0, device: torch.device | str = "cpu") -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[temperature] * n,
        top_p=[1.0] * n,
        top_k=[0] * n,
        seed=list(range(n)),
        offset=[0] * n,
        n_rows=n,
        device=device,
    )


def test_penalties_match_the_documented_formula() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, WIDTH, generator=g) * 3
    counts = torch.randint(0, 3, (3, WIDTH), generator=g, dtype=torch.int32)
    seen = torch.rand(3, WIDTH, generator=g) < 0.1
    p = penalties(
        3,
        presence=[0.5, 0.0, -1.0],
        frequency=[0.25, 1.5, 0.0],
        repetition=[1.3, 1.0, 0.8],
        logit_bias=[{5: 10.0, 7: -100.0}, {}, {1023: 3.0}],
    )
    got = apply_penalties(
        logits, counts, seen, p.presence, p.frequency, p.repetition, p.bias_ids, p.bias_values
    ).double()

    x = logits.double().numpy()
    c = counts.double().numpy()
    rep = np.array([1.3, 1.0, 0.8])[:, None]
    hit = (c > 0) | seen.numpy()
    want = np.where(hit, np.where(x > 0, x / rep, x * rep), x)
    want -= np.array([0.25, 1.5, 0.0])[:, None] * c
    want -= np.array([0.5, 0.0, -1.0])[:, None] * (c > 0)
    want[0, 5] += 10.0
    want[0, 7] -= 100.0
    want[2, 1023] += 3.0
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)


def test_unpenalised_rows_are_unchanged() -> None:
    logits = torch.randn(2, WIDTH)
    counts = torch.ones(2, WIDTH, dtype=torch.int32)
    p = penalties(2)
    out = apply_penalties(
        logits,
        counts,
        torch.ones(2, WIDTH, dtype=torch.bool),
        p.presence,
        p.frequency,
        p.repetition,
        p.bias_ids,
        p.bias_values,
    )
    assert torch.equal(out, logits)


def test_no_bias_reallows_a_token_the_grammar_forbids() -> None:
    logits = torch.zeros(1, WIDTH)
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, [3, 4]] = True
    p = penalties(1, logit_bias=[{t: 100.0 for t in range(5, 305)}])
    biased = apply_penalties(
        logits,
        torch.zeros(1, WIDTH, dtype=torch.int32),
        torch.zeros(1, WIDTH, dtype=torch.bool),
        p.presence,
        p.frequency,
        p.repetition,
        p.bias_ids,
        p.bias_values,
    )
    mask = packed_from_allowed(allowed)
    for temperature in (0.0, 1.0):
        s = greedy(1, temperature)
        for seed in range(20):
            s.seed[0] = seed
            tok = sample_tokens(
                biased, mask, s.temperature, s.top_p, s.top_k, s.seed, s.offset, vocab_size=VOCAB
            )
            assert int(tok[0]) in (3, 4)


def test_bias_of_an_allowed_token_changes_the_choice() -> None:
    logits = torch.zeros(1, WIDTH)
    logits[0, 3] = 5.0
    p = penalties(1, logit_bias=[{4: 10.0}])
    out = apply_penalties(
        logits,
        torch.zeros(1, WIDTH, dtype=torch.int32),
        torch.zeros(1, WIDTH, dtype=torch.bool),
        p.presence,
        p.frequency,
        p.repetition,
        p.bias_ids,
        p.bias_values,
    )
    assert int(out.argmax()) == 4


def test_bias_buffer_is_bounded() -> None:
    with pytest.raises(ValueError, match="300"):
        penalties(1, logit_bias=[{t: 1.0 for t in range(BIAS_WIDTH + 1)}])


def test_occurrence_table_counts_per_slot() -> None:
    table = OccurrenceTable(slots=3, logits_size=WIDTH, device="cpu")
    table.reset(1, [7, 8, 8])
    table.add([(1, 5), (1, 5), (2, 9), (1, 6)])
    counts, seen = table.rows(torch.tensor([1, 2, 0]))
    assert counts.shape == seen.shape == (3, WIDTH)
    assert counts[0, 5] == 2 and counts[0, 6] == 1 and counts[1, 9] == 1
    assert int(counts.sum()) == 4
    assert seen[0, [7, 8]].all() and int(seen.sum()) == 2
    table.reset(1, [])  # the slot's next request starts over
    counts, seen = table.rows(torch.tensor([1]))
    assert int(counts.sum()) == 0 and not seen.any()


def _logprobs(
    logits: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float,
    tokens: torch.Tensor,
    raw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    return token_logprobs(
        logits,
        logits,
        mask,
        torch.full((n,), temperature),
        tokens,
        torch.full((n,), raw),
        vocab_size=VOCAB,
    )


def test_masked_logprobs_sum_to_one_over_the_allowed_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, WIDTH, generator=g) * 4
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, [11, 200, 999]] = True
    mask = packed_from_allowed(allowed)
    chosen, ids, lps = _logprobs(logits, mask, 1.0, torch.tensor([200]), raw=False)
    assert ids.shape == lps.shape == (1, TOP_WIDTH)
    assert set(ids[0, :3].tolist()) == {11, 200, 999}
    assert torch.isinf(lps[0, 3:]).all()  # forbidden tokens: -inf, sorted last
    assert float(lps[0, :3].exp().sum()) == pytest.approx(1.0, abs=1e-5)
    assert float(chosen[0]) == pytest.approx(float(lps[0][ids[0] == 200][0]))
    # Raw mode: the model's own distribution, which spreads mass over every token.
    raw_chosen, _, raw_lps = _logprobs(logits, mask, 1.0, torch.tensor([200]), raw=True)
    assert float(raw_chosen[0]) < float(chosen[0])
    assert float(raw_lps[0].exp().sum()) < 1.0
    want = torch.log_softmax(logits[0, :VOCAB].double(), -1)[200]
    assert float(raw_chosen[0]) == pytest.approx(float(want), abs=1e-4)


def test_greedy_token_has_the_highest_logprob() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, WIDTH, generator=g) * 2
    logits[:, VOCAB:] = 1e4  # padding columns are never candidates
    s = greedy(4)
    tokens = sample_tokens(
        logits, None, s.temperature, s.top_p, s.top_k, s.seed, s.offset, vocab_size=VOCAB
    )
    chosen, ids, lps = _logprobs(logits, None, 0.0, tokens, raw=False)
    assert torch.equal(ids[:, 0], tokens)
    assert torch.allclose(chosen, lps[:, 0])
    assert (ids < VOCAB).all()


def test_temperature_shapes_the_processed_distribution() -> None:
    logits = torch.zeros(1, WIDTH)
    logits[0, 1] = 2.0
    hot, _, _ = _logprobs(logits, None, 2.0, torch.tensor([1]), raw=False)
    cold, _, _ = _logprobs(logits, None, 0.5, torch.tensor([1]), raw=False)
    z = torch.zeros(1, VOCAB, dtype=torch.float64)
    z[0, 1] = 1.0
    assert float(hot[0]) == pytest.approx(float(torch.log_softmax(z, -1)[0, 1]), abs=1e-5)
    assert float(cold[0]) > float(hot[0])


def test_compiled_penalty_and_logprob_graphs_do_not_recompile(device: torch.device) -> None:
    """On every test device: the first CUDA run found a worker warm-up graph that inductor could
    not build, and these graphs were the sampler's only ones the CUDA tests had not compiled."""
    s = Sampler(
        vocab_size=VOCAB,
        logits_size=WIDTH,
        max_rows=16,
        device=device,
        structured_outputs=True,
        compile=True,
    )
    s.warmup([1, 4])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(3)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for n in (1, 4, 11):
            logits = torch.randn(n, WIDTH, generator=g).to(device)
            counts = torch.randint(0, 3, (n, WIDTH), generator=g, dtype=torch.int32).to(device)
            seen = (torch.rand(n, WIDTH, generator=g) < 0.1).to(device)
            p = penalties(
                n,
                device,
                presence=[0.5] * n,
                frequency=[0.1 * i for i in range(n)],
                repetition=[1.2] * n,
                logit_bias=[{i: 5.0} for i in range(n)],
            )
            out = s.penalize(logits, counts, seen, p)
            want = apply_penalties(
                logits,
                counts,
                seen,
                p.presence,
                p.frequency,
                p.repetition,
                p.bias_ids,
                p.bias_values,
            )
            assert torch.allclose(out, want, atol=1e-5)
            mask = s.all_ones_mask(n)
            tokens = s(out, mask, greedy(n, device=device))
            lp = s.logprobs(
                logits,
                out,
                mask,
                torch.ones(n, device=device),
                tokens,
                torch.tensor([i % 2 == 0 for i in range(n)], device=device),
            )
            assert lp.top_ids.shape == (n, TOP_WIDTH)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
