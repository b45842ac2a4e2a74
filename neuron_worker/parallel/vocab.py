"""Vocabulary slices of a tensor-parallel group, on the packed mask's 32-token word boundaries.

The LM head and the embedding are split by rows of the model's vocabulary (its logits dimension,
which may exceed the tokenizer's). Every slice starts on a multiple of 32 so that a rank's part of
a packed grammar mask row (DESIGN.md, "Bitmask format") is a contiguous run of whole int32 words:
no bit shifting, the words travel as they are. Slices differ by at most one word; the last one
ends at the vocabulary size (ragged when that is not a multiple of 32).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from maskwire.bitmask import words_per_row

__all__ = ["VocabShard", "shard_mask_words", "vocab_shards"]


@dataclass(frozen=True)
class VocabShard:
    """One rank's slice of the vocabulary: token ids ``[start, stop)``, mask words
    ``[word_start, word_stop)`` (``start == 32 * word_start``)."""

    rank: int
    world: int
    start: int
    stop: int
    word_start: int
    word_stop: int

    @property
    def width(self) -> int:
        """Logits columns on this rank."""
        return self.stop - self.start

    @property
    def words(self) -> int:
        """Packed mask words on this rank."""
        return self.word_stop - self.word_start


def vocab_shards(vocab_size: int, world: int) -> list[VocabShard]:
    """Split ``vocab_size`` token ids over ``world`` ranks on word boundaries.

    The ``ceil(vocab_size / 32)`` words are dealt out contiguously, the first ``words % world``
    ranks taking one extra. Raises ``ValueError`` when there are fewer words than ranks (a rank
    would hold no token).
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    words = words_per_row(vocab_size)
    if words < world:
        raise ValueError(f"{vocab_size} tokens ({words} mask words) cannot be split over {world}")
    base, extra = divmod(words, world)
    shards = []
    word = 0
    for rank in range(world):
        n = base + (1 if rank < extra else 0)
        start, stop = 32 * word, min(32 * (word + n), vocab_size)
        shards.append(VocabShard(rank, world, start, stop, word, word + n))
        word += n
    return shards


def shard_mask_words(packed: Tensor, shard: VocabShard) -> Tensor:
    """A rank's words of full-vocabulary packed mask rows: int32 ``[N, W]`` -> ``[N, shard.words]``.

    ``W`` is the tokenizer's word count, which may be smaller than the model's: words of the
    slice past ``W`` (padded embedding rows) come back as 0, i.e. never allowed. Bit ``i`` of
    local word ``j`` is token ``shard.start + 32 * j + i``. Pure and static-shape.
    """
    have = min(packed.shape[1], shard.word_stop) - shard.word_start
    if have >= shard.words:
        return packed[:, shard.word_start : shard.word_stop]
    out = packed.new_zeros((packed.shape[0], shard.words))
    if have > 0:
        out[:, :have] = packed[:, shard.word_start : shard.word_start + have]
    return out
