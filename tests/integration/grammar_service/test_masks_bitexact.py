"""Masks over the wire equal llguidance's in-process masks bit for bit, state after state."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import llguidance
import numpy as np
import pytest

from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from tests.integration.grammar_service.client import SessionClient, allowed, masks, row, text_tokens

COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "status": {"enum": ["new", "paid", "shipped"]},
        "total": {"type": "number"},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["id", "status", "total", "lines"],
}
ARITH = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


@dataclass
class Case:
    name: str
    constraint: common_pb2.Constraint
    grammar: str
    text: str


def cases() -> list[Case]:
    def js(name: str, schema: dict[str, object], value: object) -> Case:
        text = json.dumps(value, ensure_ascii=False)
        return Case(
            name,
            common_pb2.Constraint(json_schema=json.dumps(schema)),
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT),  # type: ignore[arg-type]
            text,
        )

    choices = ["yes", "no", "maybe so", "maybe not"]
    regex = r"[A-Z][a-z]+ [0-9]{2,4}(\.[0-9]+)?"
    return [
        js("person", PERSON, {"name": 'Ann "Lee" \u00e9', "age": 31, "tags": ["a b", "c"]}),
        js(
            "order",
            ORDER,
            {"id": "AB-123", "status": "paid", "total": 12.5, "lines": [{"sku": "x-1", "qty": 2}]},
        ),
        Case(
            "regex",
            common_pb2.Constraint(regex=regex),
            llguidance.LLMatcher.grammar_from_regex(regex),
            "Paris 2024.75",
        ),
        Case(
            "lark",
            common_pb2.Constraint(lark=ARITH),
            llguidance.LLMatcher.grammar_from_lark(ARITH),
            "(12+3)*45-6/7",
        ),
        Case(
            "choice",
            common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=choices)),
            llguidance.grammar_from("choice", json.dumps(choices)),
            "maybe not",
        ),
    ]


@pytest.mark.parametrize("compact", [False, True], ids=["dense", "compact"])
@pytest.mark.parametrize("tokenizer_name", ["smollm", "tekken"])
def test_wire_masks_equal_llguidance(
    tokenizer_name: str, compact: bool, gs_channel: grpc.Channel, request: pytest.FixtureRequest
) -> None:
    tok: Tokenizer = request.getfixturevalue(tokenizer_name)
    w = tok.words_per_row
    client = SessionClient(gs_channel)
    all_cases = cases()
    local = {}
    tokens = {}
    for c in all_cases:
        opened = client.open(c.name, tok, c.constraint)
        assert not opened.HasField("error"), opened.error
        local[c.name] = llguidance.LLMatcher(tok.ll, c.grammar, log_level=0)
        tokens[c.name] = text_tokens(tok, c.text)
        assert tok.ll.decode_bytes(tokens[c.name]) == c.text.encode()

    pos = dict.fromkeys(local, 0)
    states = 0
    encodings: set[int] = set()
    wire_bytes = 0
    # Every case is one row of each step until its text is used up: row order is checked too.
    while True:
        live = [c.name for c in all_cases if pos[c.name] <= len(tokens[c.name])]
        if not live:
            break
        rows = []
        for name in live:
            new = tokens[name][pos[name] - 1 : pos[name]] if pos[name] else []
            rows.append(row(name, pos[name], new))
        res = client.step(rows, compact=compact)
        assert res.words_per_row == w and res.vocab_size == tok.vocab_size
        if compact:
            assert len(res.mask_row_encodings) == len(live)
            encodings.update(res.mask_row_encodings)
            wire_bytes += len(res.bitmask) + len(res.mask_word_index) + len(res.mask_word_values)
        else:
            assert not res.mask_row_encodings and not res.mask_word_values
            assert len(res.bitmask) == len(live) * w * 4
        got = masks(res)
        for k, name in enumerate(live):
            r = res.rows[k]
            assert r.request_id == name and r.status == 1 and r.mask_rows == 1, r
            m = local[name]
            if pos[name]:
                assert m.consume_token(tokens[name][pos[name] - 1]), m.get_error()
            want = np.frombuffer(m.compute_bitmask(), dtype="<i4")[:w]
            assert np.array_equal(got[k], want), f"{name} state {pos[name]}"
            assert r.accepting == m.is_accepting()
            if pos[name] < len(tokens[name]):
                assert allowed(got[k], tokens[name][pos[name]])
            states += 1
            pos[name] += 1
    assert states > 60
    if compact:
        # Both lists are used (few tokens allowed between keys, almost all inside strings) and
        # the answers are far smaller than dense ones.
        assert {
            grammar_pb2.MASK_ROW_ENCODING_SPARSE_ZEROS,
            grammar_pb2.MASK_ROW_ENCODING_SPARSE_ONES,
        } <= encodings
        assert wire_bytes < states * w * 4 / 2
    for c in all_cases:
        assert client.close(c.name).found
    client.end()


def test_compact_answers_equal_dense_ones_with_drafts_reasoning_and_errors(
    gs_channel: grpc.Channel, tekken: Tokenizer
) -> None:
    """The same steps on two streams, one dense and one compact: same rows, same masks, for
    every kind of row (drafts, jump-forward, unconstrained reasoning, errors, unknown ids)."""
    person = common_pb2.Constraint(json_schema=json.dumps(PERSON))
    text = json.dumps({"name": "Bo", "age": 7, "tags": ["q"]})
    toks = text_tokens(tekken, text)
    think = text_tokens(tekken, "hmm </think>")
    streams = {c: SessionClient(gs_channel) for c in (False, True)}
    for client in streams.values():
        assert not client.open("plain", tekken, person).HasField("error")
        assert not client.open("ff", tekken, person, jump_forward=True).HasField("error")
        assert not client.open("think", tekken, person, reasoning_end_marker="</think>").HasField(
            "error"
        )
        assert not client.open("dies", tekken, person).HasField("error")
    ff_pos = 0
    for k in range(1, len(toks) - 3):
        rows = [
            row("plain", k, toks[k - 1 : k], toks[k : k + 3]),  # drafts
            row("ff", ff_pos),
            row("think", k, think[k - 1 : k] if k <= len(think) else toks[:0]),
            row("dies", k, [tekken.vocab_size + 5] if k == 1 else toks[k - 1 : k]),
            row("nobody", 1, [5]),
        ]
        if k > len(think):
            rows[2] = row("think", len(think), [])
        got = {c: client.step(rows, compact=c) for c, client in streams.items()}
        dense, compact = got[False], got[True]
        assert len(compact.mask_row_encodings) == sum(r.mask_rows for r in compact.rows)
        for a, b in zip(dense.rows, compact.rows, strict=True):
            assert a == b
        np.testing.assert_array_equal(masks(dense), masks(compact))
        assert compact.rows[0].accepted_drafts == 3 and compact.rows[0].mask_rows == 4
        ff_pos = compact.rows[1].position
        if compact.rows[1].finished:
            break
    assert ff_pos > 0
    for client in streams.values():
        client.end()
