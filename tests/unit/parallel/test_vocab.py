"""Vocabulary slices on mask-word boundaries and each rank's words of a full packed mask."""

from __future__ import annotations

import itertools

import pytest
import torch

from maskwire.bitmask import words_per_row
from neuron_worker.masks import unpack_mask
from neuron_worker.parallel import shard_mask_words, vocab_shards


@pytest.mark.parametrize("vocab", [300, 1000, 49_152, 49_159, 131_072])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_slices_cover_the_vocabulary_on_word_boundaries(vocab: int, world: int) -> None:
    shards = vocab_shards(vocab, world)
    assert [s.rank for s in shards] == list(range(world))
    assert shards[0].start == 0 and shards[-1].stop == vocab
    for a, b in itertools.pairwise(shards):
        assert a.stop == b.start and a.word_stop == b.word_start
    for s in shards:
        assert s.start == 32 * s.word_start and s.start % 32 == 0
        assert s.width > 0 and s.words == words_per_row(s.width)
    sizes = [s.words for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_last_slice_is_ragged_when_the_vocabulary_is_not_a_multiple_of_32n() -> None:
    shards = vocab_shards(49_159, 2)  # 1537 words: 769 + 768, the last word holds 7 tokens
    assert [(s.start, s.stop) for s in shards] == [(0, 24_608), (24_608, 49_159)]
    assert shards[1].words == 768 and shards[1].width == 24_551


def test_more_ranks_than_words_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split"):
        vocab_shards(64, 3)


def _random_packed(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (rows, words_per_row(vocab)), generator=g).to(torch.int32)


@pytest.mark.parametrize("vocab", [49_152, 131_072, 50_021])
@pytest.mark.parametrize("world", [2, 3])
def test_rank_words_are_bit_exact_against_the_full_mask(vocab: int, world: int) -> None:
    packed = _random_packed(4, vocab, seed=vocab)
    packed[1] = -1  # an unconstrained row
    full = unpack_mask(packed, vocab)
    for shard in vocab_shards(vocab, world):
        words = shard_mask_words(packed, shard)
        assert words.dtype == torch.int32 and words.shape == (4, shard.words)
        assert torch.equal(unpack_mask(words, shard.width), full[:, shard.start : shard.stop])


def test_model_columns_past_the_tokenizer_vocabulary_are_never_allowed() -> None:
    tokenizer_vocab, model_vocab = 49_152, 49_280  # padded embeddings: 4 extra words
    packed = torch.full((2, words_per_row(tokenizer_vocab)), -1, dtype=torch.int32)
    last = vocab_shards(model_vocab, 2)[1]
    words = shard_mask_words(packed, last)
    allowed = unpack_mask(words, last.width)
    inside = tokenizer_vocab - last.start
    assert allowed[:, :inside].all() and not allowed[:, inside:].any()
