"""maskwire.bitmask: compact rows decode to exactly the dense rows they were encoded from."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from maskwire.bitmask import (
    DENSE,
    REPEAT,
    SPARSE_ONES,
    SPARSE_ZEROS,
    CompactRows,
    decode_rows,
    encode_rows,
    ones_row,
    step_masks,
)
from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path
from maskwire.v1 import grammar_pb2

COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def roundtrip(rows: np.ndarray, vocab: int) -> CompactRows:
    c = encode_rows(rows, vocab)
    got = decode_rows(
        c.encodings, c.counts, c.dense, c.index, c.values, vocab, repeat_of=c.repeat_of
    )
    assert got.dtype == np.int32 and np.array_equal(got, rows)
    return c


def rows_with(vocab: int, allowed_sets: list[list[int]]) -> np.ndarray:
    w = (vocab + 31) // 32
    out = np.zeros((len(allowed_sets), w), dtype=np.uint32)
    for r, ids in enumerate(allowed_sets):
        for t in ids:
            out[r, t >> 5] |= np.uint32(1 << (t & 31))
    return out.view(np.int32)


def test_encodings_match_the_proto_enum() -> None:
    assert grammar_pb2.MASK_ROW_ENCODING_REPEAT == REPEAT
    assert grammar_pb2.MASK_ROW_ENCODING_DENSE == DENSE
    assert grammar_pb2.MASK_ROW_ENCODING_SPARSE_ZEROS == SPARSE_ZEROS
    assert grammar_pb2.MASK_ROW_ENCODING_SPARSE_ONES == SPARSE_ONES


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
    enc = c.encodings.tolist()
    assert enc[0] == SPARSE_ZEROS and c.counts[0] == 0
    assert enc[1] == SPARSE_ONES and c.counts[1] == 0
    if w > 3:
        assert enc[4] == SPARSE_ZEROS and c.counts[4] == 2
        assert enc[5] == SPARSE_ONES and c.counts[5] == 1
    # Listed rows never cost more than dense ones.
    assert len(c.index) + len(c.values) + len(c.dense) <= rows.nbytes
    assert np.array_equal(ones_row(vocab), rows_with(vocab, [full])[0])
    if w > 3:
        assert enc[7] == DENSE and enc[8] == DENSE  # no base fits: sent dense


def test_step_masks_reads_dense_and_compact_answers() -> None:
    vocab = 49152
    rows = rows_with(vocab, [[3, 4000], list(range(100, vocab)), list(range(0, vocab, 2))])
    dense = grammar_pb2.StepResult(bitmask=rows.tobytes(), words_per_row=rows.shape[1])
    assert np.array_equal(step_masks(dense), rows)
    c = encode_rows(rows, vocab)
    compact = grammar_pb2.StepResult(
        bitmask=c.dense,
        words_per_row=rows.shape[1],
        vocab_size=vocab,
        mask_row_encodings=c.encodings.tolist(),
        mask_row_word_counts=c.counts.tolist(),
        mask_word_index=c.index,
        mask_word_values=c.values,
        mask_row_repeat_of=c.repeat_of.tolist(),
    )
    assert compact.ByteSize() < rows.nbytes / 2
    buf = np.zeros((8, rows.shape[1]), dtype=np.int32)
    for res in (dense, compact):
        got = step_masks(res, out=buf)
        assert np.shares_memory(got, buf) and np.array_equal(got, rows)
    with pytest.raises(ValueError, match="vocab_size"):
        step_masks(grammar_pb2.StepResult(words_per_row=7, mask_row_encodings=[DENSE]))


def test_random_rows_and_reused_out_buffer() -> None:
    rng = np.random.default_rng(0)
    vocab = 5000
    for density in (0.0005, 0.01, 0.3, 0.5, 0.97, 0.9995):
        bits = rng.random((17, vocab)) < density
        rows = rows_with(vocab, [list(np.flatnonzero(b)) for b in bits])
        c = roundtrip(rows, vocab)
        out = np.full((32, rows.shape[1]), 12345, dtype=np.int32)
        got = decode_rows(
            c.encodings, c.counts, c.dense, c.index, c.values, vocab, out=out, repeat_of=c.repeat_of
        )
        assert np.shares_memory(got, out) and np.array_equal(out[:17], rows)
        assert (out[17:] == 12345).all()


def test_rows_that_mislead_the_sample_are_sent_dense() -> None:
    vocab = 131072  # 4096 words: the encoder samples every 32nd word to pick a row's base
    w = vocab // 32
    looks_empty = np.full(w, -1, dtype=np.int32)
    looks_empty[::32] = 0  # every sampled word is 0, every other one is all ones
    looks_full = np.zeros(w, dtype=np.int32)
    looks_full[::32] = -1
    few = rows_with(vocab, [[5, 70000], [6, 70001], [7, 99]])
    rows = np.stack([few[0], looks_empty, few[1], looks_full, few[2]])
    c = roundtrip(rows, vocab)
    assert c.encodings.tolist() == [SPARSE_ZEROS, DENSE, SPARSE_ZEROS, DENSE, SPARSE_ZEROS]
    assert c.counts.tolist() == [2, 0, 2, 0, 2]
    assert len(c.index) + len(c.values) + len(c.dense) <= rows.nbytes


def test_equal_rows_are_sent_once() -> None:
    vocab = 4096
    a, b = rows_with(vocab, [[1, 2, 3], list(range(100, 4000))])
    c = a.copy()
    c[0:2], c[2:4] = a[2:4], a[0:2]  # word pairs swapped: equal sums of words and of pairs
    assert c.view(np.uint64).sum() == a.view(np.uint64).sum() and not np.array_equal(a, c)
    rows = np.stack([a, b, a, c, b, a])
    enc = roundtrip(rows, vocab)
    assert enc.encodings.tolist()[2:] == [REPEAT, SPARSE_ZEROS, REPEAT, REPEAT]
    assert enc.repeat_of.tolist() == [0, 1, 0]
    alone = encode_rows(rows[:2], vocab)
    assert (enc.dense, enc.values) == (
        alone.dense,
        alone.values + encode_rows(c[None], vocab).values,
    )


def test_bits_past_the_vocab_are_kept() -> None:
    vocab = 40  # 2 words; the all-allowed row has bits 40..63 zero
    rows = np.array([[-1, -1], [-1, 0xFF]], dtype=np.int32)
    roundtrip(rows, vocab)


def test_malformed_input_is_rejected() -> None:
    vocab = 64
    ok = encode_rows(rows_with(vocab, [[1, 2], [3]]), vocab)
    with pytest.raises(ValueError, match="index and"):
        decode_rows(ok.encodings, ok.counts, ok.dense, ok.index + b"\0\0", ok.values, vocab)
    one = np.array([5], "<u2").tobytes()
    with pytest.raises(ValueError, match="out of range"):
        decode_rows([SPARSE_ZEROS], [1], b"", one, b"\1\0\0\0", vocab)
    with pytest.raises(ValueError, match="unknown"):
        decode_rows([9], [0], b"", b"", b"", vocab)
    with pytest.raises(ValueError, match="dense bytes"):
        decode_rows([DENSE], [0], b"\x00" * 4, b"", b"", vocab)
    with pytest.raises(ValueError, match="word counts"):
        decode_rows([SPARSE_ONES], [3], b"", b"", b"", vocab)
    with pytest.raises(ValueError, match="out must be"):
        decode_rows([SPARSE_ZEROS], [0], b"", b"", b"", vocab, out=np.zeros((1, 3), np.int32))
    zeros_then_repeat = ([SPARSE_ZEROS, REPEAT], [0, 0], b"", b"", b"", vocab)
    with pytest.raises(ValueError, match="repeat_of entries"):
        decode_rows(*zeros_then_repeat)
    for bad in ([1], [2], [-1]):  # itself, past itself, negative
        with pytest.raises(ValueError, match="earlier row"):
            decode_rows(*zeros_then_repeat, repeat_of=bad)
    with pytest.raises(ValueError, match="earlier row"):  # a repeat of a repeat
        decode_rows([SPARSE_ZEROS, REPEAT, REPEAT], [0, 0, 0], b"", b"", b"", vocab, None, [0, 1])
    with pytest.raises(ValueError, match="word counts"):
        decode_rows([SPARSE_ZEROS, REPEAT], [0, 1], b"", b"\0\0", b"\0" * 4, vocab, None, [0])
    assert decode_rows(*zeros_then_repeat, repeat_of=[0]).tolist() == [[0, 0], [0, 0]]


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
    assert {SPARSE_ZEROS, SPARSE_ONES, REPEAT} <= kinds  # between keys, in strings, same states
    assert len(c.index) + len(c.values) + len(c.dense) < rows.nbytes / 2
    # Each row decodes the same alone as in the batch.
    for r in range(0, len(rows), 7):
        one = roundtrip(rows[r : r + 1], vocab)
        if c.encodings[r] != REPEAT:
            assert one.encodings[0] == c.encodings[r]
