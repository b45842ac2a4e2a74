"""Compact mask rows: encode dense int32 bitmask rows as token-id lists, decode them back.

The dense row format is DESIGN.md's ("Bitmask format"): ``W = ceil(V / 32)`` little-endian int32
words, bit ``i`` of word ``j`` = token ``32*j + i``, 1 = allowed, bits at or past ``V`` zero.
JSON-schema states allow either very few tokens (between keys: a handful) or almost all of them
(inside a string: all but the ~2% containing a quote, a backslash or a control character), so a
row is usually far smaller as the list of its allowed tokens (``ALLOW``) or of its forbidden ones
(``DENY``) than as 16 KB of words. The wire layout (``StepResult`` with ``Step.compact_masks``,
see docs/protocol.md):

* ``encodings[r]``: ``DENSE``, ``ALLOW`` or ``DENY`` for mask row ``r``.
* ``counts[r]``: how many token ids row ``r`` lists (0 for ``DENSE``).
* ``dense``: the ``DENSE`` rows' words, in row order (``StepResult.bitmask``).
* ``ids``: every listed row's ids, in row order, each row's ids ascending and delta-coded: the
  value for an id is the number of tokens skipped since the previous id of the row (for the first
  id: since token 0), written as an unsigned LEB128 varint (protobuf's varint).
  ``ALLOW`` rows are zero except the listed ids; ``DENY`` rows allow every token in ``[0, V)``
  except the listed ids.

Both directions are vectorised numpy over the whole step (no Python loop over rows or tokens).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from maskwire.v1 import grammar_pb2

assert sys.byteorder == "little", "mask words are the host's int32 words: little-endian only"

DENSE = 1
ALLOW = 2
DENY = 3
"""Row encodings; equal to `maskwire.v1.grammar_pb2.MASK_ROW_ENCODING_*`."""

__all__ = [
    "ALLOW",
    "DENSE",
    "DENY",
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
    ids: bytes


def ones_row(vocab_size: int) -> np.ndarray:
    """The all-allowed row for a vocabulary: ones for tokens ``[0, V)``, zeros past it."""
    words = (vocab_size + 31) // 32
    row = np.full(words, -1, dtype=np.int32)
    tail = vocab_size % 32
    if tail:
        row[-1] = np.int32(np.uint32((1 << tail) - 1).view(np.int32))
    return row


def encode_rows(rows: np.ndarray, vocab_size: int, max_ids: int | None = None) -> CompactRows:
    """Encode int32 ``[n, W]`` rows. A row is listed (``ALLOW`` / ``DENY``) when it has at most
    ``max_ids`` allowed / forbidden tokens (default ``W``: at most ~2 bytes per id against 4 per
    word, so a listed row is never larger than its dense form), else sent ``DENSE``."""
    n, words = rows.shape
    if words != (vocab_size + 31) // 32:
        raise ValueError(
            f"rows have {words} words; vocab {vocab_size} needs {(vocab_size + 31) // 32}"
        )
    limit = words if max_ids is None else max_ids
    if n == 0:
        return CompactRows(np.zeros(0, np.int32), np.zeros(0, np.int64), b"", b"")
    allowed = np.bitwise_count(rows.view(np.uint32)).sum(axis=1, dtype=np.int64)
    enc = np.full(n, DENSE, dtype=np.int32)
    enc[allowed <= limit] = ALLOW
    deny = (vocab_size - allowed <= limit) & (enc == DENSE)
    if vocab_size % 32 and deny.any():
        # A row with bits set past V cannot be described as a DENY list: keep it dense.
        ones = ones_row(vocab_size)
        deny &= (rows[:, -1] & ~ones[-1]) == 0
    enc[deny] = DENY
    listed = np.flatnonzero(enc != DENSE)
    dense_idx = np.flatnonzero(enc == DENSE)
    counts = np.zeros(n, dtype=np.int64)
    dense = rows[dense_idx].tobytes() if len(dense_idx) else b""
    if not len(listed):
        return CompactRows(enc, counts, dense, b"")
    work = rows[listed].view(np.uint32)
    deny_listed = enc[listed] == DENY
    if deny_listed.any():
        work = work.copy()
        work[deny_listed] ^= ones_row(vocab_size).view(np.uint32)
    # The set bits of `work` are the ids to list, row by row, ascending. Find the non-zero words
    # first (most words of a listed row are zero), then the set bits of those words only.
    flat = work.reshape(-1)
    widx = np.flatnonzero(flat != 0)
    bits = np.unpackbits(flat[widx].view(np.uint8), bitorder="little").view(bool)
    p = np.flatnonzero(bits)
    gid = widx[p >> 5] * 32 + (p & 31)  # bit index in the listed block: row * 32W + token
    row_bits = words * 32
    rows_of = gid // row_bits
    ids = gid - rows_of * row_bits
    counts[listed] = np.bincount(rows_of, minlength=len(listed))
    # Delta-code within each row: gap = id - previous id - 1 (first id of a row: gap = id).
    gaps = np.empty_like(ids)
    if len(ids):
        gaps[0] = ids[0]
        gaps[1:] = ids[1:] - ids[:-1] - 1
        first = np.flatnonzero(rows_of[1:] != rows_of[:-1]) + 1
        gaps[first] = ids[first]
    return CompactRows(enc, counts, dense, _varints(gaps))


def decode_rows(
    encodings: np.ndarray | list[int],
    counts: np.ndarray | list[int],
    dense: bytes,
    ids: bytes,
    vocab_size: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode compact rows into int32 ``[n, W]``: into ``out[:n]`` (reused, must be C-contiguous
    int32 with ``W`` columns and at least ``n`` rows; rows past ``n`` are left alone) or a new
    array. Raises ``ValueError`` on malformed input (never writes past ``out``)."""
    enc = np.asarray(encodings, dtype=np.int32)
    cnt = np.asarray(counts, dtype=np.int64)
    n = len(enc)
    words = (vocab_size + 31) // 32
    if len(cnt) != n:
        raise ValueError(f"{n} encodings but {len(cnt)} counts")
    if out is None:
        out = np.empty((n, words), dtype=np.int32)
    elif (
        out.dtype != np.int32
        or out.ndim != 2
        or out.shape[1] != words
        or out.shape[0] < n
        or not out.flags.c_contiguous
    ):
        raise ValueError(f"out must be a C-contiguous int32 array of shape [>= {n}, {words}]")
    if n == 0:
        return out[:0]
    if not np.isin(enc, (DENSE, ALLOW, DENY)).all():
        raise ValueError(f"unknown mask row encoding in {sorted(set(enc.tolist()))}")
    is_dense = enc == DENSE
    if (cnt[is_dense] != 0).any() or (cnt < 0).any():
        raise ValueError("dense rows list no ids; counts are >= 0")
    dense_idx = np.flatnonzero(is_dense)
    if len(dense) != len(dense_idx) * words * 4:
        raise ValueError(f"{len(dense)} dense bytes for {len(dense_idx)} rows of {words} words")
    view = out[:n]
    if len(dense_idx):
        view[dense_idx] = np.frombuffer(dense, dtype="<i4").reshape(-1, words)
    view[enc == ALLOW] = 0
    view[enc == DENY] = ones_row(vocab_size)
    total = int(cnt.sum())
    gaps = _read_varints(ids)
    if len(gaps) != total:
        raise ValueError(f"{len(gaps)} ids for {total} listed")
    if not total:
        return view
    # Ids: per row, cumulative (gap + 1) - 1.
    steps = gaps + 1
    csum = np.cumsum(steps)
    rows_of = np.repeat(np.arange(n), cnt)
    ends = np.cumsum(cnt)
    before = np.concatenate(([0], csum))[ends - cnt]  # cumsum before each row's first id
    tok = csum - before[rows_of] - 1
    if tok.max() >= vocab_size:
        raise ValueError(f"token id {int(tok.max())} is out of range [0, {vocab_size})")
    flat_word = rows_of * words + (tok >> 5)
    bit = np.left_shift(np.uint32(1), (tok & 31).astype(np.uint32))
    # ALLOW rows start at 0 and DENY rows at all ones; ids are distinct, so adding a row's bits
    # per word (a sum of distinct bits = their OR) and XOR-ing it in sets (ALLOW) or clears (DENY) exactly the listed bits.
    new_word = np.empty(len(flat_word), dtype=bool)
    new_word[0] = True
    np.not_equal(flat_word[1:], flat_word[:-1], out=new_word[1:])
    group = np.cumsum(new_word) - 1
    combined = np.bincount(group, weights=bit).astype(np.uint32)  # exact: sums < 2**32
    view.reshape(-1).view(np.uint32)[flat_word[new_word]] ^= combined
    return view


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
    if not vocab or (vocab + 31) // 32 != words:
        raise ValueError(f"vocab_size {vocab} does not match words_per_row {words}")
    return decode_rows(
        result.mask_row_encodings,
        result.mask_row_id_counts,
        result.bitmask,
        result.mask_ids,
        vocab,
        out,
    )


def _varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of non-negative int64 values (< 2**35), concatenated."""
    v = values.astype(np.int64, copy=False)
    big = np.flatnonzero(v >= 0x80)
    if not len(big):
        return v.astype(np.uint8).tobytes()
    nbytes = np.ones(len(v), dtype=np.int64)
    for k in range(1, 5):
        nbytes[big] += v[big] >= (1 << (7 * k))
    start = np.cumsum(nbytes) - nbytes
    out = np.empty(int(start[-1] + nbytes[-1]), dtype=np.uint8)
    out[start] = v & 0x7F
    out[start[big]] |= 0x80
    for k in range(1, int(nbytes.max())):
        sel = big[nbytes[big] > k]
        more = (nbytes[sel] > k + 1).astype(np.int64) << 7
        out[start[sel] + k] = ((v[sel] >> (7 * k)) & 0x7F) | more
    return out.tobytes()


def _read_varints(data: bytes) -> np.ndarray:
    """Inverse of `_varints` (int64)."""
    b = np.frombuffer(data, dtype=np.uint8)
    if not len(b):
        return np.zeros(0, dtype=np.int64)
    last = b < 0x80
    if last.all():
        return b.astype(np.int64)
    if not last[-1]:
        raise ValueError("truncated varint in mask ids")
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 5:
        raise ValueError("varint longer than 5 bytes in mask ids")
    pos = np.arange(len(b)) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.int64) << (7 * pos)
    return np.add.reduceat(parts, starts)
