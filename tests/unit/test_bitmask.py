"""maskwire.bitmask: compact rows decode to exactly the dense rows they were encoded from."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from maskwire.bitmask import (
    ALLOW,
    DENSE,
    DENY,
    CompactRows,
    _read_varints,
    _varints,
    decode_rows,
    encode_rows,
    ones_row,
)
from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path

COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def roundtrip(rows: np.ndarray, vocab: int, **kw: int) -> CompactRows:
    c = encode_rows(rows, vocab, **kw)
    got = decode_rows(c.encodings, c.counts, c.dense, c.ids, vocab)
    assert got.dtype == np.int32 and np.array_equal(got, rows)
    return c


def rows_with(vocab: int, allowed_sets: list[list[int]]) -> np.ndarray:
    w = (vocab + 31) // 32
    out = np.zeros((len(allowed_sets), w), dtype=np.uint32)
    for r, ids in enumerate(allowed_sets):
        for t in ids:
            out[r, t >> 5] |= np.uint32(1 << (t & 31))
    return out.view(np.int32)


def test_varints_roundtrip_every_length() -> None:
    vals = np.array([0, 1, 127, 128, 300, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**32], np.int64)
    data = _varints(vals)
    assert len(data) == 1 + 1 + 1 + 2 + 2 + 2 + 3 + 3 + 4 + 5 + 5
    assert _read_varints(data).tolist() == vals.tolist()
    assert _varints(np.array([5, 0], np.int64)) == b"\x05\x00"


@pytest.mark.parametrize("vocab", [49152, 131072, 1000, 33])
def test_edge_rows(vocab: int) -> None:
    w = (vocab + 31) // 32
    full = list(range(vocab))
    sets = [
        [],
        full,
        [0],
        [vocab - 1],
        [0, vocab - 1],  # one gap of almost V: a multi-byte varint
        full[1:],
        full[:-1],
        [t for t in full if t % 7],
        list(range(0, vocab, 3)),
    ]
    rows = rows_with(vocab, sets)
    c = roundtrip(rows, vocab)
    assert c.encodings[0] == ALLOW and c.counts[0] == 0
    assert c.encodings[1] == DENY and c.counts[1] == 0
    assert c.encodings[4] == ALLOW and c.counts[4] == 2
    assert c.encodings[5] == DENY and c.counts[5] == 1
    # Listed rows never cost more than dense ones.
    assert len(c.ids) + len(c.dense) <= rows.nbytes + 16
    assert np.array_equal(ones_row(vocab), rows_with(vocab, [full])[0])
    # Everything dense when listing is off.
    d = roundtrip(rows, vocab, max_ids=-1)
    assert (d.encodings == DENSE).all() and d.dense == rows.tobytes() and d.ids == b""
    assert w == rows.shape[1]


def test_random_rows_and_reused_out_buffer() -> None:
    rng = np.random.default_rng(0)
    vocab = 5000
    for density in (0.0005, 0.01, 0.3, 0.5, 0.97, 0.9995):
        bits = rng.random((17, vocab)) < density
        rows = rows_with(vocab, [list(np.flatnonzero(b)) for b in bits])
        c = roundtrip(rows, vocab)
        out = np.full((32, rows.shape[1]), 12345, dtype=np.int32)
        got = decode_rows(c.encodings, c.counts, c.dense, c.ids, vocab, out=out)
        assert np.shares_memory(got, out) and np.array_equal(out[:17], rows)
        assert (out[17:] == 12345).all()


def test_bits_past_the_vocab_keep_a_row_dense() -> None:
    vocab = 40  # 2 words; bits 40..63 must be zero in a DENY row
    rows = np.array([[-1, -1]], dtype=np.int32)
    c = roundtrip(rows, vocab)
    assert c.encodings.tolist() == [DENSE]


def test_malformed_input_is_rejected() -> None:
    vocab = 64
    ok = encode_rows(rows_with(vocab, [[1, 2], [3]]), vocab)
    with pytest.raises(ValueError, match="ids for"):
        decode_rows(ok.encodings, ok.counts, ok.dense, ok.ids + b"\x01", vocab)
    with pytest.raises(ValueError, match="out of range"):
        decode_rows([ALLOW], [1], b"", _varints(np.array([64])), vocab)
    with pytest.raises(ValueError, match="unknown"):
        decode_rows([9], [0], b"", b"", vocab)
    with pytest.raises(ValueError, match="dense bytes"):
        decode_rows([DENSE], [0], b"\x00" * 4, b"", vocab)
    with pytest.raises(ValueError, match="truncated"):
        decode_rows([ALLOW], [1], b"", b"\x80", vocab)
    with pytest.raises(ValueError, match="out must be"):
        decode_rows([ALLOW], [0], b"", b"", vocab, out=np.zeros((1, 3), np.int32))


SCHEMAS = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}},
                "kind": {"enum": ["a", "bb", "ccc"]},
            },
            "required": ["name", "age", "tags", "kind"],
        },
        {"name": 'Zoë "Q" \\ x', "age": 41, "tags": ["x y", "", "日本"], "kind": "bb"},
    ),
    (
        {"type": "array", "items": {"type": "number"}},
        [1.5, -2e3, 0, 12345.678],
    ),
]


@pytest.mark.parametrize("spec", ["default", "tekken"])
def test_real_llguidance_states_bit_exact(spec: str) -> None:
    tok: Tokenizer = load_tokenizer(str(tekken_path()) if spec == "tekken" else spec)
    vocab = tok.vocab_size
    w = tok.words_per_row
    dense_rows = []
    for schema, value in SCHEMAS:
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)  # type: ignore[arg-type]
        m = llguidance.LLMatcher(tok.ll, g, log_level=0)
        for t in tok.ll.tokenize_str(json.dumps(value, ensure_ascii=False)):
            dense_rows.append(np.frombuffer(m.compute_bitmask(), dtype="<i4")[:w])
            assert m.consume_token(t), m.get_error()
        dense_rows.append(np.frombuffer(m.compute_bitmask(), dtype="<i4")[:w])
    rows = np.stack(dense_rows)
    assert len(rows) > 40
    c = roundtrip(rows, vocab)
    kinds = set(c.encodings.tolist())
    assert {ALLOW, DENY} <= kinds  # between keys and inside strings
    assert len(c.ids) + len(c.dense) < rows.nbytes / 4
    # Each row decodes the same alone as in the batch.
    for r in range(0, len(rows), 7):
        one = roundtrip(rows[r : r + 1], vocab)
        assert one.encodings[0] == c.encodings[r]
