"""Compact mask rows: send only the words of a row that differ from all-zero or all-one.

The dense row format is DESIGN.md's ("Bitmask format"): ``W = ceil(V / 32)`` little-endian int32
words, bit ``i`` of word ``j`` = token ``32*j + i``, 1 = allowed, bits at or past ``V`` zero.
JSON-schema states allow either very few tokens (between keys: a handful, so a few non-zero
words) or almost all of them (inside a string: all but the ~2% containing a quote, a backslash or
a control character, so ~40% of the words are not all ones), so most rows are far smaller as
"a base row plus the words that differ from it" than as 16 KB of words. The wire layout
(``StepResult`` with ``Step.compact_masks``, see docs/protocol.md):

* ``encodings[r]``: ``DENSE``, ``SPARSE_ZEROS`` (base: every word 0), ``SPARSE_ONES`` (base:
  every token in ``[0, V)`` allowed) or ``REPEAT`` (the same words as an earlier row) for mask
  row ``r``.
* ``counts[r]``: how many words row ``r`` lists (0 for ``DENSE`` and ``REPEAT``).
* ``repeat_of``: for each ``REPEAT`` row, in order, the earlier non-``REPEAT`` row it repeats.
* ``dense``: the ``DENSE`` rows' words, in row order (``StepResult.bitmask``).
* ``index``: for every listed word, rows in order, words ascending within a row: its word index
  in the row, a little-endian uint16 (so ``W <= 65536``, ``V <= 2**21``; larger vocabularies
  are always sent dense).
* ``values``: the listed words themselves, little-endian int32, same order.

A listed word costs 6 bytes against 4 for a dense one, so a row is listed only when fewer than
2/3 of its words differ from the base. Both directions are a few vectorised numpy passes over
the whole step (no Python loop over rows, words or tokens). Encoding finds the rows equal to an
earlier one (a 64-bit sum per row, confirmed by a compare), picks each other row's base from a
sample of its words, then is one compare per base, a count and a gather; decoding is a fill, one
scatter and one copy for the repeats. 64 Tekken rows: ~290 µs to encode, ~110 µs to decode.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from maskwire.v1 import grammar_pb2


def words_per_row(vocab_size: int) -> int:
    """``ceil(vocab_size / 32)``: int32 words in one packed mask row (DESIGN.md, bitmask format)."""
    return (vocab_size + 31) // 32


assert sys.byteorder == "little", "mask words are the host's int32 words: little-endian only"

DENSE = 1
SPARSE_ZEROS = 2
SPARSE_ONES = 3
REPEAT = 4
"""Row encodings; equal to `maskwire.v1.grammar_pb2.MASK_ROW_ENCODING_*`."""

MAX_SPARSE_WORDS = 65536
"""Rows wider than this are always dense (word indices are uint16)."""

_SAMPLE_WORDS = 128
"""Words per row the encoder samples to choose a row's base."""

__all__ = [
    "DENSE",
    "REPEAT",
    "SPARSE_ONES",
    "SPARSE_ZEROS",
    "CompactRows",
    "decode_rows",
    "encode_rows",
    "ones_row",
    "step_masks",
]


@dataclass(frozen=True)
class CompactRows:
    """The compact form of `n` mask rows (see the module docstring)."""

    encodings: np.ndarray  # int32 [n]
    counts: np.ndarray  # int64 [n]
    dense: bytes
    index: bytes
    values: bytes
    repeat_of: np.ndarray  # int64 [number of REPEAT rows]: the earlier row each one repeats


def ones_row(vocab_size: int) -> np.ndarray:
    """The all-allowed row for a vocabulary: ones for tokens ``[0, V)``, zeros past it."""
    words = words_per_row(vocab_size)
    row = np.full(words, -1, dtype=np.int32)
    tail = vocab_size % 32
    if tail:
        row[-1] = np.int32(np.uint32((1 << tail) - 1).view(np.int32))
    return row


def encode_rows(rows: np.ndarray, vocab_size: int) -> CompactRows:
    """Encode int32 ``[n, W]`` rows: a row equal to an earlier one as a REPEAT of it, every other
    row as the cheapest of dense / sparse-zeros / sparse-ones."""
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    n, words = rows.shape
    if words != words_per_row(vocab_size):
        raise ValueError(
            f"rows have {words} words; vocab {vocab_size} needs {words_per_row(vocab_size)}"
        )
    no_repeats = np.zeros(0, dtype=np.int64)
    if n == 0 or words > MAX_SPARSE_WORDS:
        enc, counts = np.full(n, DENSE, dtype=np.int32), np.zeros(n, dtype=np.int64)
        return CompactRows(enc, counts, rows.tobytes(), b"", b"", no_repeats)
    source = _first_equal_rows(rows)
    repeats = source != np.arange(n)
    if not repeats.any():
        enc, counts, dense, index, values = _encode_distinct(rows, vocab_size)
        return CompactRows(enc, counts, dense, index, values, no_repeats)
    distinct = ~repeats
    sub_enc, sub_counts, dense, index, values = _encode_distinct(rows[distinct], vocab_size)
    enc = np.full(n, REPEAT, dtype=np.int32)
    counts = np.zeros(n, dtype=np.int64)
    enc[distinct] = sub_enc
    counts[distinct] = sub_counts
    return CompactRows(enc, counts, dense, index, values, source[repeats].astype(np.int64))


def _first_equal_rows(rows: np.ndarray) -> np.ndarray:
    """For each row, the index of the first row equal to it (itself when none comes earlier).

    Rows are bucketed by a 64-bit sum of their words; a candidate is confirmed word for word, so a
    sum collision only costs a compare.
    """
    n, words = rows.shape
    # A wrapping 64-bit sum; word pairs as uint64 when the row width allows (4x faster).
    keys = rows.view(np.uint64).sum(axis=1) if words % 2 == 0 else rows.sum(axis=1, dtype=np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    source = first[inverse.reshape(-1)]
    candidates = np.flatnonzero(source != np.arange(n))
    if len(candidates):
        same = (rows[candidates] == rows[source[candidates]]).all(axis=1)
        source[candidates[~same]] = candidates[~same]
    return source


def _encode_distinct(
    rows: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, bytes, bytes, bytes]:
    """Each row as the cheapest of dense / sparse-zeros / sparse-ones."""
    n, words = rows.shape
    enc = np.full(n, DENSE, dtype=np.int32)
    counts = np.zeros(n, dtype=np.int64)
    # Pick each row's base from a sample of its words (the choice only affects the size, never
    # the decoded row), then find the words that differ from it exactly, in one pass per base.
    stride = max(1, words // _SAMPLE_WORDS)
    sample = rows[:, ::stride]
    ones = ones_row(vocab_size)
    zero_share = np.count_nonzero(sample == 0, axis=1)
    ones_share = np.count_nonzero(sample == ones[::stride], axis=1)
    enough = sample.shape[1] // 3  # a row is worth listing when > 1/3 of its words match a base
    base_zero = (zero_share >= ones_share) & (zero_share > enough)
    base_ones = ~base_zero & (ones_share > enough)
    limit = (2 * words) // 3
    listed = np.zeros((n, words), dtype=bool)
    if base_zero.any():
        listed[base_zero] = rows[base_zero] != 0
    if base_ones.any():
        listed[base_ones] = rows[base_ones] != ones
    flat = np.flatnonzero(listed)
    # Per-row counts and in-row indices from row boundaries: no division over every listed word.
    starts = np.arange(n + 1, dtype=np.int64) * words
    per_row = np.diff(np.searchsorted(flat, starts))
    sparse = (base_zero | base_ones) & (per_row < limit)
    in_row = flat - np.repeat(starts[:-1], per_row)
    if not sparse.all():  # rows whose sample misled us go dense after all
        keep = np.repeat(sparse, per_row)
        flat = flat[keep]
        in_row = in_row[keep]
    enc[sparse & base_zero] = SPARSE_ZEROS
    enc[sparse & base_ones] = SPARSE_ONES
    counts[sparse] = per_row[sparse]
    is_dense = ~sparse
    dense = rows[is_dense].tobytes() if is_dense.any() else b""
    index = in_row.astype("<u2").tobytes()
    values = rows.reshape(-1)[flat].tobytes()
    return enc, counts, dense, index, values


def decode_rows(
    encodings: np.ndarray | list[int],
    counts: np.ndarray | list[int],
    dense: bytes,
    index: bytes,
    values: bytes,
    vocab_size: int,
    out: np.ndarray | None = None,
    repeat_of: np.ndarray | Sequence[int] = (),
) -> np.ndarray:
    """Decode compact rows into int32 ``[n, W]``: into ``out[:n]`` (reused, must be C-contiguous
    int32 with ``W`` columns and at least ``n`` rows; rows past ``n`` are left alone) or a new
    array. Raises ``ValueError`` on malformed input (never writes outside ``out[:n]``)."""
    enc = np.asarray(encodings, dtype=np.int32)
    cnt = np.asarray(counts, dtype=np.int64)
    n = len(enc)
    words = words_per_row(vocab_size)
    if len(cnt) != n:
        raise ValueError(f"{n} encodings but {len(cnt)} counts")
    view = _output_rows(out, n, words)
    if n == 0:
        return view
    sources = np.asarray(repeat_of, dtype=np.int64)
    is_dense, repeat_rows = _check_encodings(enc, cnt, words, sources)
    n_dense = int(np.count_nonzero(is_dense))
    if len(dense) != n_dense * words * 4:
        raise ValueError(f"{len(dense)} dense bytes for {n_dense} rows of {words} words")
    total = int(cnt.sum())
    if len(index) != 2 * total or len(values) != 4 * total:
        raise ValueError(f"{len(index)} index and {len(values)} value bytes for {total} words")
    if n_dense == n:
        view[:] = np.frombuffer(dense, dtype="<i4").reshape(n, words)
        return view
    if n_dense:
        view[is_dense] = np.frombuffer(dense, dtype="<i4").reshape(-1, words)
    view[enc == SPARSE_ZEROS] = 0
    view[enc == SPARSE_ONES] = ones_row(vocab_size)
    if total:
        idx = np.frombuffer(index, dtype="<u2").astype(np.int64)
        if idx.max() >= words:
            raise ValueError(f"word index {int(idx.max())} is out of range [0, {words})")
        idx += np.repeat(np.arange(n, dtype=np.int64) * words, cnt)
        view.reshape(-1)[idx] = np.frombuffer(values, dtype="<i4")
    if len(repeat_rows):  # sources are never repeats, so they are final by now
        view[repeat_rows] = view[sources]
    return view


def _output_rows(out: np.ndarray | None, n: int, words: int) -> np.ndarray:
    """`out[:n]` once `out` is checked to fit (a new ``[n, words]`` array when None)."""
    if out is None:
        return np.empty((n, words), dtype=np.int32)
    if (
        out.dtype != np.int32
        or out.ndim != 2
        or out.shape[1] != words
        or out.shape[0] < n
        or not out.flags.c_contiguous
    ):
        raise ValueError(f"out must be a C-contiguous int32 array of shape [>= {n}, {words}]")
    return out[:n]


def _check_encodings(
    enc: np.ndarray, cnt: np.ndarray, words: int, sources: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(the dense rows as a bool mask, the repeat rows' indices) once every row's
    encoding, word count and repeat source is checked; ValueError otherwise."""
    is_dense = enc == DENSE
    is_repeat = enc == REPEAT
    if not (is_dense | is_repeat | (enc == SPARSE_ZEROS) | (enc == SPARSE_ONES)).all():
        raise ValueError(f"unknown mask row encoding in {sorted(set(enc.tolist()))}")
    if (cnt[is_dense | is_repeat] != 0).any() or (cnt < 0).any() or (cnt > words).any():
        raise ValueError(f"word counts must be 0 for dense and repeat rows and in [0, {words}]")
    repeat_rows = np.flatnonzero(is_repeat)
    if len(sources) != len(repeat_rows):
        raise ValueError(f"{len(repeat_rows)} repeat rows but {len(sources)} repeat_of entries")
    if len(sources) and (
        (sources < 0).any() or (sources >= repeat_rows).any() or is_repeat[sources].any()
    ):
        raise ValueError("a repeat row must name an earlier row that is not itself a repeat")
    return is_dense, repeat_rows


def step_masks(result: grammar_pb2.StepResult, out: np.ndarray | None = None) -> np.ndarray:
    """A `StepResult`'s mask rows as int32 ``[sum(rows.mask_rows), W]``, dense or compact.

    Without `out`, a dense answer is returned as a read-only view of ``result.bitmask`` (no copy)
    and a compact one is decoded into a new array; with `out` (a reused C-contiguous int32
    ``[capacity, W]`` buffer), the rows are written into ``out[:n]`` and that view is returned.
    Raises ``ValueError`` for a malformed answer.
    """
    words = result.words_per_row
    if not words:
        raise ValueError("StepResult.words_per_row is 0")
    if not len(result.mask_row_encodings):
        if len(result.bitmask) % (4 * words):
            raise ValueError(
                f"bitmask of {len(result.bitmask)} bytes is not whole {words}-word rows"
            )
        rows = np.frombuffer(result.bitmask, dtype="<i4").reshape(-1, words)
        if out is None:
            return rows
        if out.shape[0] < len(rows) or out.shape[1:] != (words,) or out.dtype != np.int32:
            raise ValueError(f"out must be int32 [>= {len(rows)}, {words}]")
        out[: len(rows)] = rows
        return out[: len(rows)]
    vocab = result.vocab_size
    if not vocab or words_per_row(vocab) != words:
        raise ValueError(f"vocab_size {vocab} does not match words_per_row {words}")
    return decode_rows(
        result.mask_row_encodings,
        result.mask_row_word_counts,
        result.bitmask,
        result.mask_word_index,
        result.mask_word_values,
        vocab,
        out,
        result.mask_row_repeat_of,
    )
