"""The masked sampler: masking semantics, sampling semantics against a float64 reference,
per-request random streams, and the Sampler wrapper (variants, validation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_worker.masks import mask_dest_index, scatter_mask_rows, words_per_row
from neuron_worker.sampler import (
    BLOCK_STREAM,
    COLUMN_STREAM,
    INNER_STREAM,
    NO_TOKEN,
    WORD,
    Sampler,
    SamplingTensors,
    keyed_uniform,
    sample_tokens,
)

V = 49_152  # SmolLM2: a multiple of 32
L = 49_280  # padded embedding rows: wider logits than the tokenizer vocab


def params(
    n: int,
    *,
    temperature: float | list[float] = 0.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    seed: int | list[int] = 0,
    offset: int | list[int] = 0,
    device: torch.device | str = "cpu",
) -> SamplingTensors:
    def each(v: object) -> list:
        return list(v) if isinstance(v, list) else [v] * n  # type: ignore[call-overload]

    return SamplingTensors.build(
        temperature=each(temperature),
        top_p=each(top_p),
        top_k=each(top_k),
        seed=each(seed),
        offset=each(offset),
        n_rows=n,
        device=device,
    )


def sampler(device: torch.device | str, *, vocab: int = V, logits: int = L, **kw: bool) -> Sampler:
    opts = {"structured_outputs": True, "compile": False, **kw}
    return Sampler(vocab_size=vocab, logits_size=logits, max_rows=64, device=device, **opts)


def packed_from_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> int32 [N, ceil(V/32)] in the wire bit order."""
    n, v = allowed.shape
    w = words_per_row(v)
    padded = torch.zeros(n, 32 * w, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.reshape(n, w, 32) << torch.arange(32)).sum(-1)
    return words.to(torch.int32)  # wraps into int32 two's complement


def uniforms(seed: int, offset: int, ids: np.ndarray, stream: int) -> np.ndarray:
    """The sampler's random numbers for one row (float64)."""
    u = keyed_uniform(torch.tensor([seed]), torch.tensor([offset]), torch.tensor(ids), stream)
    return u[0].double().numpy()


def reference_sample(
    logits: np.ndarray,
    allowed: np.ndarray | None,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    offset: int,
    vocab: int,
) -> int:
    """Independent float64 sampler with the documented semantics: Gumbel-max over 32-column
    blocks and inverse CDF inside the winner; with top-k / top-p, Gumbel-max over the kept
    columns."""
    x = logits[:vocab].astype(np.float64)
    if allowed is not None:
        x = np.where(allowed[:vocab], x, -np.inf)
        if not allowed[:vocab].any():
            return NO_TOKEN
    if temperature == 0:
        return int(np.argmax(x))
    p = np.exp((x - x.max()) / temperature)
    p /= p.sum()
    if top_k == 0 and top_p >= 1:
        blocks = -(-vocab // WORD)
        mass = np.array([p[b * WORD : (b + 1) * WORD].sum() for b in range(blocks)])
        with np.errstate(divide="ignore"):
            race = np.log(mass) - np.log(
                -np.log(uniforms(seed, offset, np.arange(blocks), BLOCK_STREAM))
            )
        b = int(np.argmax(race))
        inner = p[b * WORD : (b + 1) * WORD]
        u = uniforms(seed, offset, np.array([b]), INNER_STREAM)[0]
        return b * WORD + int(np.searchsorted(np.cumsum(inner), u * inner.sum(), side="left"))
    order = np.lexsort((np.arange(vocab), -x))  # by logit, then by id
    ps = p[order]
    keep = np.ones_like(ps, dtype=bool)
    if top_k:
        keep[top_k:] = False
    before = np.cumsum(ps) - ps
    keep &= before < top_p
    keep[0] = True
    gumbel = -np.log(-np.log(uniforms(seed, offset, order, COLUMN_STREAM)))
    z = np.where(keep, x[order] / temperature + gumbel, -np.inf)
    return int(order[int(np.argmax(z))])


# --- masking -------------------------------------------------------------------------------


def test_greedy_unmasked_is_argmax_within_vocab(device: torch.device) -> None:
    logits = torch.randn(4, L, generator=torch.Generator().manual_seed(0))
    logits[:, V:] = 100.0  # padded columns never win
    s = sampler(device)
    out = s(logits.to(device), s.all_ones_mask(4), params(4, device=device)).cpu()
    assert torch.equal(out, logits[:, :V].argmax(-1))


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_single_allowed_token_always_wins(device: torch.device, temperature: float) -> None:
    n = 8
    logits = torch.randn(n, L, generator=torch.Generator().manual_seed(1))
    chosen = torch.tensor([0, 31, 32, 1000, 4095, V - 33, V - 2, V - 1])
    allowed = torch.zeros(n, V, dtype=torch.bool)
    allowed[torch.arange(n), chosen] = True
    logits[torch.arange(n), chosen] = -50.0  # the only allowed token is the least likely
    s = sampler(device)
    for top_k, top_p in [(0, 1.0), (5, 0.5)]:
        p = params(
            n, temperature=temperature, top_k=top_k, top_p=top_p, seed=list(range(n)), device=device
        )
        out = s(logits.to(device), packed_from_allowed(allowed).to(device), p).cpu()
        assert out.tolist() == chosen.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_zeros_row_yields_no_token_without_touching_others(
    device: torch.device, temperature: float
) -> None:
    logits = torch.randn(3, L, generator=torch.Generator().manual_seed(2))
    s = sampler(device)
    mask = s.all_ones_mask(3)
    mask[1] = 0
    out = s(
        logits.to(device), mask, params(3, temperature=temperature, seed=[1, 2, 3], device=device)
    )
    out = out.cpu()
    assert out[1].item() == NO_TOKEN
    assert 0 <= out[0].item() < V and 0 <= out[2].item() < V


def test_alternating_mask_allows_only_even_tokens(device: torch.device) -> None:
    n = 16
    logits = torch.randn(n, L, generator=torch.Generator().manual_seed(3))
    mask = torch.full((n, words_per_row(V)), 0x55555555, dtype=torch.int32)
    s = sampler(device)
    for temperature in (0.0, 1.0):
        p = params(n, temperature=temperature, seed=list(range(n)), device=device)
        out = s(logits.to(device), mask.to(device), p).cpu()
        assert (out % 2 == 0).all()
        if temperature == 0:
            assert torch.equal(out, logits[:, 0:V:2].argmax(-1) * 2)


@pytest.mark.parametrize(
    ("vocab", "width"),
    [(128_256, 128_256), (128_256, 128_512), (49_152, 49_280), (50_001, 50_001), (50_001, 50_048)],
)
def test_columns_past_vocab_never_sampled(device: torch.device, vocab: int, width: int) -> None:
    n = 4
    logits = torch.full((n, width), -10.0)
    logits[:, vocab - 1] = 0.0
    logits[:, vocab:] = 1e4  # would win any unmasked argmax
    s = sampler(device, vocab=vocab, logits=width)
    ones = s.all_ones_mask(n)
    for t in (0.0, 1.0):
        out = s(
            logits.to(device), ones, params(n, temperature=t, seed=[5, 6, 7, 8], device=device)
        ).cpu()
        assert (out < vocab).all() and (out >= 0).all()
    nomask = sampler(device, vocab=vocab, logits=width, structured_outputs=False)
    out = nomask(logits.to(device), None, params(n, device=device)).cpu()
    assert out.tolist() == [vocab - 1] * n


def test_mixed_batch_with_draft_rows(device: torch.device) -> None:
    """Reorder + sample: constrained rows in service order with draft rows, unconstrained rows."""
    n, w = 8, words_per_row(V)
    logits = torch.randn(n, L, generator=torch.Generator().manual_seed(4))
    # Service order: request A at batch row 5 with one accepted draft (rows 5, 6) allowing token
    # 10 then 20; request B unconstrained (row 0); request C at row 2 allowing 40..47.
    allowed = torch.zeros(3, V, dtype=torch.bool)
    allowed[0, 10] = allowed[1, 20] = True
    allowed[2, 40:48] = True
    compact = torch.full((6, w), 7, dtype=torch.int32)  # junk beyond the 3 real rows
    compact[:3] = packed_from_allowed(allowed)
    dest = mask_dest_index([5, 0, 2], [2, 0, 1], n_rows=n, size=6)
    mask = scatter_mask_rows(compact.to(device), dest.to(device), n)
    s = sampler(device)
    out = s(logits.to(device), mask, params(n, device=device)).cpu()
    want = logits[:, :V].argmax(-1)
    want[5], want[6] = 10, 20
    want[2] = 40 + logits[2, 40:48].argmax()
    assert out.tolist() == want.tolist()


# --- sampling semantics ----------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_reference(device: torch.device, masked: bool) -> None:
    n, vocab, width = 32, 50_001, 50_048
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(n, width, generator=g) * 3
    allowed = torch.rand(n, vocab, generator=g) < 0.3
    allowed[3] = False
    allowed[4] = False
    allowed[4, 12_345] = True
    temps = [0.0, 0.7, 1.0, 1.5] * 8
    top_ks = [0, 0, 5, 0, 50, 0, 1, 0] * 4
    top_ps = [1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 1.0, 0.3] * 4
    seeds = [1000 + i for i in range(n)]
    offsets = [i * 7 for i in range(n)]
    p = params(
        n, temperature=temps, top_k=top_ks, top_p=top_ps, seed=seeds, offset=offsets, device=device
    )
    s = sampler(device, vocab=vocab, logits=width, structured_outputs=masked)
    mask = packed_from_allowed(allowed).to(device) if masked else None
    out = s(logits.to(device), mask, p).cpu().tolist()
    want = [
        reference_sample(
            logits[i].numpy(),
            allowed[i].numpy() if masked else None,
            temps[i],
            top_ps[i],
            top_ks[i],
            seeds[i],
            offsets[i],
            vocab,
        )
        for i in range(n)
    ]
    assert out == want


def test_top_k_and_top_p_keep_only_the_head(device: torch.device) -> None:
    n = 64
    logits = torch.full((n, L), -30.0)
    logits[:, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])  # probabilities ~ .64 .24 .09 .03
    s = sampler(device)
    seeds = list(range(n))
    out_k = s(
        logits.to(device),
        s.all_ones_mask(n),
        params(n, temperature=1.0, top_k=2, seed=seeds, device=device),
    )
    assert set(out_k.cpu().tolist()) == {0, 1}
    out_p = s(
        logits.to(device),
        s.all_ones_mask(n),
        params(n, temperature=1.0, top_p=0.8, seed=seeds, device=device),
    )
    assert set(out_p.cpu().tolist()) == {0, 1}
    out_1 = s(
        logits.to(device),
        s.all_ones_mask(n),
        params(n, temperature=1.0, top_k=1, seed=seeds, device=device),
    )
    assert set(out_1.cpu().tolist()) == {0}


def test_same_seed_and_offset_same_token_whatever_the_batch(device: torch.device) -> None:
    g = torch.Generator().manual_seed(6)
    row = torch.randn(1, L, generator=g)
    s = sampler(device)
    alone = s(
        row.to(device),
        s.all_ones_mask(1),
        params(1, temperature=1.0, seed=42, offset=3, device=device),
    )
    for n in (4, 16):
        logits = torch.randn(n, L, generator=g)
        logits[n - 1] = row[0]
        seeds = [int(x) for x in torch.randint(0, 2**40, (n,), generator=g)]
        seeds[n - 1] = 42
        offsets = [0] * n
        offsets[n - 1] = 3
        # Other rows greedy, filtered or random, constrained or not: the sorting graph included.
        temps = [0.0, 1.0, 0.5, 1.0] * (n // 4)
        temps[n - 1] = 1.0
        top_ks = [0, 5, 0, 0] * (n // 4)
        top_ks[n - 1] = 0
        mask = s.all_ones_mask(n)
        mask[0, :100] = 0
        p = params(n, temperature=temps, top_k=top_ks, seed=seeds, offset=offsets, device=device)
        assert p.mode == "filter"
        assert s(logits.to(device), mask, p)[n - 1].item() == alone.item()


def test_seeds_offsets_ids_and_streams_change_the_numbers() -> None:
    def u(seed: object, offset: object, ids: object, stream: int = BLOCK_STREAM) -> torch.Tensor:
        return keyed_uniform(torch.tensor(seed), torch.tensor(offset), torch.tensor(ids), stream)

    by_seed = u(list(range(1000)), [0] * 1000, [5])
    by_offset = u([0] * 1000, list(range(1000)), [5])
    by_id = u([0], [0], list(range(1000)))
    assert by_seed.shape == by_offset.shape == (1000, 1) and by_id.shape == (1, 1000)
    for x in (by_seed, by_offset, by_id):
        assert x.unique().numel() > 990
        assert ((x > 0) & (x < 1)).all()
    streams = torch.cat([u([0], [0], list(range(1000)), s) for s in (1, 2, 3)])
    assert streams.unique().numel() > 2970
    big = u([-1, 2**63 - 1, -(2**63)], [0, 2**40, 5], [0, 2**32 - 1])
    assert ((big > 0) & (big < 1)).all()
    # Per-row ids ([N, L]) are the same numbers as shared ones.
    ids = torch.arange(64)
    rows = keyed_uniform(torch.tensor([3, 4]), torch.tensor([1, 2]), ids.expand(2, 64), 1)
    assert torch.equal(rows, keyed_uniform(torch.tensor([3, 4]), torch.tensor([1, 2]), ids, 1))
    # Uniform over ids and over seeds: 20 bins, chi-square under the 99.9% critical value (43.8).
    for x in (u([9], [9], list(range(20_000))), u(list(range(20_000)), [9] * 20_000, [9])):
        counts = torch.histc(x, 20, 0, 1)
        chi2 = ((counts - 1000) ** 2 / 1000).sum().item()
        assert chi2 < 43.8


def test_empirical_distribution_matches_softmax() -> None:
    """4,000 draws (seeds 0..3999) of a masked 6-token distribution whose tokens lie in 4 blocks
    of 32 columns, two of them in one block: chi-square under the 99.9% critical value for 5
    degrees of freedom (20.5). Deterministic: the seeds are fixed."""
    n = 4000
    tokens = [0, 5, 40, 70, 71, 200, 6, 255]  # the last two are likely but not allowed
    logits = torch.zeros(n, 256)
    logits[:, tokens] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 9.0, 9.0])
    allowed = torch.zeros(n, 256, dtype=torch.bool)
    allowed[:, tokens[:6]] = True
    s = Sampler(
        vocab_size=256,
        logits_size=256,
        max_rows=n,
        device="cpu",
        structured_outputs=True,
        compile=False,
    )
    out = s(logits, packed_from_allowed(allowed), params(n, temperature=1.3, seed=list(range(n))))
    counts = torch.bincount(out, minlength=256).double()[tokens]
    assert counts[6:].sum() == 0 and counts.sum() == n
    probs = torch.softmax(logits[0, tokens[:6]].double() / 1.3, -1)
    chi2 = ((counts[:6] - n * probs) ** 2 / (n * probs)).sum().item()
    assert chi2 < 20.5, (counts, n * probs)


# --- the Sampler wrapper ----------------------------------------------------------------------


def test_build_flags_and_padding() -> None:
    p = SamplingTensors.build(
        temperature=[0, 0], top_p=[0.5, 1], top_k=[3, 0], seed=[1, 2], offset=[0, 0], n_rows=4
    )
    assert p.mode == "greedy" and p.temperature.shape == (4,)
    p = SamplingTensors.build(
        temperature=[0, 1],
        top_p=[0.5, 1],
        top_k=[3, 0],
        seed=[1, 2**64 + 5],
        offset=[0, 0],
        n_rows=2,
    )
    assert p.mode == "sample" and p.seed.tolist() == [1, 5]
    p = SamplingTensors.build(
        temperature=[1], top_p=[0.9], top_k=[0], seed=[1], offset=[0], n_rows=1
    )
    assert p.mode == "filter"
    with pytest.raises(ValueError):
        SamplingTensors.build(
            temperature=[1, 1], top_p=[1], top_k=[0], seed=[1], offset=[0], n_rows=2
        )


def test_variants_validate_the_mask_argument() -> None:
    logits = torch.zeros(2, L)
    with_mask = sampler("cpu")
    without = sampler("cpu", structured_outputs=False)
    with pytest.raises(ValueError, match="pass a mask"):
        with_mask(logits, None, params(2))
    with pytest.raises(ValueError, match="takes no mask"):
        without(logits, with_mask.all_ones_mask(2), params(2))
    with pytest.raises(ValueError, match="int32"):
        with_mask(logits, torch.zeros(2, 5, dtype=torch.int32), params(2))
    with pytest.raises(ValueError, match="logits must be"):
        with_mask(torch.zeros(2, V), with_mask.all_ones_mask(2), params(2))


def test_modes_agree_on_rows_they_share() -> None:
    """Greedy rows are the same token in every graph; unfiltered random rows the same in the
    'sample' and 'filter' graphs."""
    n = 8
    logits = torch.randn(n, L, generator=torch.Generator().manual_seed(7))
    mask = packed_from_allowed(torch.rand(n, V, generator=torch.Generator().manual_seed(8)) < 0.5)
    args = (
        torch.tensor([0.0, 1.0] * 4),
        torch.ones(n),
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
    )
    greedy = sample_tokens(logits, mask, *args, vocab_size=V, mode="greedy")
    sample = sample_tokens(logits, mask, *args, vocab_size=V, mode="sample")
    filt = sample_tokens(logits, mask, *args, vocab_size=V, mode="filter")
    assert torch.equal(sample, filt)
    assert torch.equal(greedy[::2], sample[::2])
