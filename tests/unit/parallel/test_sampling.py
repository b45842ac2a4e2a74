"""The sharded sampler: TP = N picks what TP = 1 picks, masks hold across shards, and only
O(batch * world) values cross ranks."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import Tensor

from maskwire.bitmask import words_per_row
from neuron_worker.parallel import ProcessGroup, ShardedSampler, shard_mask_words, vocab_shards
from neuron_worker.parallel.launch import run_ranks
from neuron_worker.parallel.sampling import combine, local_candidates
from neuron_worker.sampler import NO_TOKEN, Mode, sample_tokens
from tests.unit.parallel.shards import params, simulate

VOCAB = 300  # 10 words: 5 + 5 at TP = 2, 4 + 3 + 3 at TP = 3


def _logits(rows: int, width: int = VOCAB, seed: int = 0) -> Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 3


def _random_mask(rows: int, vocab: int, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (rows, words_per_row(vocab)), generator=g)
    return bits.to(torch.int32)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_greedy_equals_the_single_device_sampler(world: int, masked: bool) -> None:
    logits = _logits(8)
    packed = _random_mask(8, VOCAB) if masked else None
    p = params(8, temperature=0.0)
    expected = sample_tokens(
        logits, packed, p.temperature, p.top_p, p.top_k, p.seed, p.offset, vocab_size=VOCAB
    )
    assert torch.equal(simulate(logits, packed, p, world=world, vocab_size=VOCAB), expected)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.8, 0), (1.0, 0.9, 12), (0.5, 0.5, 40)],
)
def test_sampled_tokens_do_not_depend_on_the_world_size(
    temperature: float, top_p: float, top_k: int
) -> None:
    logits = _logits(32, seed=3)
    packed = _random_mask(32, VOCAB, seed=4)
    for seed in (0, 1, 12345, -9):
        p = params(32, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        one = simulate(logits, packed, p, world=1, vocab_size=VOCAB)
        assert (one >= 0).all()
        for world in (2, 3):
            assert torch.equal(simulate(logits, packed, p, world=world, vocab_size=VOCAB), one)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, 0), (0.8, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.3, 0), (1.0, 0.9, 12), (0.5, 0.5, 40)],
)
@pytest.mark.parametrize("masked", [False, True])
def test_sampled_tokens_are_the_single_device_samplers(
    temperature: float, top_p: float, top_k: int, masked: bool
) -> None:
    """The same seed gives the worker's unsharded sampler's token at every world size, whenever
    the top-k / top-p set fits the candidates (here every row's does)."""
    vocab, width = 1000, 1024  # 32 words; padded model columns past the tokenizer's vocabulary
    logits = torch.randn(64, width, generator=torch.Generator().manual_seed(21)) * 2
    packed = _random_mask(64, vocab, seed=22) if masked else None
    for seed in (7, 12345, -3):
        p = params(64, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        one = sample_tokens(
            logits,
            packed,
            p.temperature,
            p.top_p,
            p.top_k,
            p.seed,
            p.offset,
            vocab_size=vocab,
            mode=p.mode,
        )
        assert (one >= 0).all() and len(set(one.tolist())) > 8
        for world in (1, 2, 3, 5):
            got = simulate(logits, packed, p, world=world, vocab_size=vocab, candidates=64)
            assert torch.equal(got, one), (world, seed)
    if top_p < 1 and top_k == 0:  # the nucleus fits the 64 candidates, so it is not cut
        probs = torch.softmax(logits[:, :vocab] / temperature, dim=-1).sort(descending=True)[0]
        assert ((probs.cumsum(-1) - probs < top_p).sum(-1) <= 64).all()


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.0, 1.0, 0), (1.0, 1.0, 0), (2.0, 0.9, 3)]
)
def test_the_best_logit_masked_out_on_the_other_rank_never_wins(
    temperature: float, top_p: float, top_k: int
) -> None:
    rows = 64
    logits = _logits(rows, seed=5)
    shards = vocab_shards(VOCAB, 2)
    # Rank 1's slice holds the row maxima, by far, and is entirely masked off; rank 0 allows
    # three tokens.
    logits[:, shards[1].start :] += 100.0
    allowed = [3, 40, 77]
    packed = torch.zeros(rows, words_per_row(VOCAB), dtype=torch.int32)
    for t in allowed:
        packed[:, t // 32] |= 1 << (t % 32)
    p = params(rows, temperature=temperature, top_p=top_p, top_k=top_k, offsets=list(range(rows)))
    tokens = simulate(logits, packed, p, world=2, vocab_size=VOCAB)
    assert set(tokens.tolist()) <= set(allowed)
    if temperature > 0:
        assert len(set(tokens.tolist())) > 1  # really sampled among the allowed ones


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.5, 4)]
)
def test_a_row_with_nothing_allowed_anywhere_is_no_token(
    temperature: float, top_p: float, top_k: int
) -> None:
    logits = _logits(3)
    packed = torch.full((3, words_per_row(VOCAB)), -1, dtype=torch.int32)
    packed[1] = 0
    p = params(3, temperature=temperature, top_p=top_p, top_k=top_k)
    tokens = simulate(logits, packed, p, world=2, vocab_size=VOCAB)
    assert tokens[1] == NO_TOKEN and (tokens[[0, 2]] >= 0).all()


def test_padded_model_columns_are_never_sampled() -> None:
    logits = _logits(16, width=320)
    logits[:, 300:] = 1e4  # embedding rows past the tokenizer's 300 tokens
    for temperature in (0.0, 1.0):
        p = params(16, temperature=temperature)
        tokens = simulate(logits, None, p, world=2, vocab_size=300)
        assert (tokens < 300).all()


def test_sampling_follows_the_softmax_and_the_filters() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * 60])
    n = 4000
    rows = logits.expand(n, -1).contiguous()
    p = params(n, offsets=list(range(n)))
    counts = torch.bincount(simulate(rows, None, p, world=2, vocab_size=64), minlength=64)
    expected = torch.softmax(logits[0], dim=0) * n
    assert (counts[:4] - expected[:4]).abs().max() < 0.04 * n
    top2 = simulate(rows, None, params(n, top_k=2, offsets=list(range(n))), world=2, vocab_size=64)
    assert set(top2.tolist()) == {0, 1}
    # softmax(2, 1, 0, -1) = 0.64, 0.24, ...: top-p 0.7 keeps the first two.
    nucleus = simulate(
        rows, None, params(n, top_p=0.7, offsets=list(range(n))), world=2, vocab_size=64
    )
    assert set(nucleus.tolist()) == {0, 1}


def test_bytes_exchanged_grow_with_rows_and_ranks_not_the_vocabulary() -> None:
    shard = vocab_shards(131_072, 2)[0]
    sampler = ShardedSampler(shard=shard, vocab_size=131_072, group=_NoGroup(), candidates=64)
    assert sampler.bytes_per_step(8, "greedy") == 8 * 2 * 8
    assert sampler.bytes_per_step(8, "sample") == 8 * 4 * 8
    assert sampler.bytes_per_step(8, "filter") == 8 * (5 + 2 * 64) * 8


class _NoGroup:
    rank, world = 0, 2

    def all_reduce(self, x: Tensor) -> Tensor:
        raise AssertionError("not used")

    def all_gather(self, x: Tensor) -> Tensor:
        raise AssertionError("not used")


def _sample_on_rank(group: ProcessGroup, logits: Tensor, packed: Tensor) -> tuple[Tensor, int]:
    shard = vocab_shards(logits.shape[1], group.world)[group.rank]
    sampler = ShardedSampler(shard=shard, vocab_size=VOCAB, group=group, candidates=16)
    words = shard_mask_words(packed, shard)
    out = []
    for temperature, top_p, top_k in ((0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 8)):
        p = params(logits.shape[0], temperature=temperature, top_p=top_p, top_k=top_k)
        out.append(sampler(logits[:, shard.start : shard.stop], words, p))
    return torch.stack(out), group.sent_bytes


def test_two_gloo_ranks_agree_with_one(tmp_path: Path) -> None:
    logits, packed = _logits(8, seed=11), _random_mask(8, VOCAB, seed=12)
    results = run_ranks(_sample_on_rank, 2, tmp_path, logits, packed)
    (t0, sent0), (t1, sent1) = results
    assert torch.equal(t0, t1)
    expected = torch.stack(
        [
            simulate(
                logits,
                packed,
                params(8, temperature=t, top_p=tp, top_k=k),
                world=1,
                vocab_size=VOCAB,
            )
            for t, tp, k in ((0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 8))
        ]
    )
    assert torch.equal(t0, expected)
    assert sent0 == sent1 == 8 * 8 * (2 + 4 + 5 + 2 * 16)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "filter"])
def test_both_halves_compile_to_one_graph_each_and_match_eager(mode: Mode) -> None:
    """The collective sits between the halves, so each compiles with ``fullgraph=True`` (filter
    takes ~150 s on 2 loaded cores, hence slow)."""
    shard = vocab_shards(1000, 2)[1]
    p = params(4, temperature=0.8, top_k=5, top_p=0.9)
    logits, words = _logits(4, width=shard.width), _random_mask(4, 1000)[:, shard.word_start :]
    local = functools.partial(
        local_candidates, shard=shard, vocab_size=990, mode=mode, candidates=8
    )
    mine = torch.compile(local, fullgraph=True)(logits, words, p.temperature, p.seed, p.offset)
    torch.testing.assert_close(mine, local(logits, words, p.temperature, p.seed, p.offset))
    gathered = torch.stack([mine, mine.flip(0)])
    args = (gathered, p.temperature, p.top_p, p.top_k, p.seed, p.offset)
    together = functools.partial(combine, mode=mode, candidates=8)
    assert torch.equal(torch.compile(together, fullgraph=True)(*args), together(*args))
