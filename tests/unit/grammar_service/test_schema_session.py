"""The output check inside the session protocol: masks, dead ends, forced tokens, drafts, replay."""

from __future__ import annotations

import json
from typing import Any

import pytest

from grammar_service.schema import monitor
from grammar_service.session import Session
from maskwire.bitmask import step_masks
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from tests.unit.grammar_service.schema_support import allowed
from tests.unit.grammar_service.test_session import runtime

OK = grammar_pb2.ROW_STATUS_OK
ERROR = grammar_pb2.ROW_STATUS_ERROR
UNIQUE_STRINGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


async def opened(
    tok: Tokenizer, schema: Any, *, jump_forward: bool = False, replay: str = ""
) -> tuple[Session, grammar_pb2.Opened]:
    s = Session(runtime(tok))
    msg = grammar_pb2.Open(
        request_id="r",
        constraint=common_pb2.Constraint(json_schema=json.dumps(schema)),
        tokenizer=tok.fingerprint.to_proto(),
        options=grammar_pb2.RequestOptions(jump_forward=jump_forward),
        replay_tokens=tok.ll.tokenize_str(replay) if replay else [],
    )
    return s, await s.open(msg)


def step(s: Session, text: str, position: int, drafts: str = "") -> grammar_pb2.StepResult:
    tokens = s.tokenizer.ll.tokenize_str(text) if s.tokenizer and text else []
    draft_tokens = s.tokenizer.ll.tokenize_str(drafts) if s.tokenizer and drafts else []
    row = grammar_pb2.StepRow(
        request_id="r",
        new_tokens=tokens,
        position=position + len(tokens),
        draft_tokens=draft_tokens,
    )
    return s.step(grammar_pb2.Step(step=1, rows=[row]))


async def test_opened_carries_the_report(tok: Tokenizer) -> None:
    _, o = await opened(tok, UNIQUE_STRINGS)
    assert o.schema_report.validated
    assert [k.keyword for k in o.schema_report.keywords] == ["uniqueItems"]


async def test_the_mask_never_offers_a_duplicate_item(tok: Tokenizer) -> None:
    s, _ = await opened(tok, UNIQUE_STRINGS)
    res = step(s, '["ab", "ab', 0)
    assert res.rows[0].status == OK
    row = step_masks(res)[0]
    quote = tok.ll.tokenize_str('"')[0]
    assert not allowed(row, quote)  # `"` would complete a second "ab"
    assert allowed(row, tok.ll.tokenize_str("c")[0])  # "abc" is fine


async def test_a_dead_end_ends_the_request_unsatisfied(tok: Tokenizer) -> None:
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 0},
        "uniqueItems": True,
    }
    s, _ = await opened(tok, schema)
    res = step(s, "[0, 0", 0)  # every way to end the second 0 repeats the first
    row = res.rows[0]
    assert row.status == ERROR and not res.bitmask
    err = RpcError.from_status(row.error)
    assert err.reason == "CONSTRAINT_UNSATISFIABLE"
    assert err.message.startswith("constraint could not be satisfied")


async def test_forced_tokens_that_violate_end_the_request(tok: Tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"abcd": {"const": 1}},
        "required": ["abcd"],
        "propertyNames": {"pattern": "^a", "maxLength": 3},
    }
    s, _ = await opened(tok, schema, jump_forward=True)
    res = step(s, "", 0)  # the grammar forces `{"abcd": 1`: a name longer than 3
    err = RpcError.from_status(res.rows[0].error)
    assert res.rows[0].status == ERROR and err.reason == "CONSTRAINT_UNSATISFIABLE"
    assert "forces" in err.message and "propertyNames" in err.message


async def test_drafts_stop_before_the_token_that_would_violate(tok: Tokenizer) -> None:
    s, _ = await opened(tok, UNIQUE_STRINGS)
    drafts = '"b", "b"]'
    res = step(s, '["a", ', 0, drafts=drafts)
    row = res.rows[0]
    ids = tok.ll.tokenize_str(drafts)
    closing = [
        i for i in range(len(ids)) if b"".join(map(tok.token_bytes, ids[: i + 1])).count(b'"') >= 4
    ]
    cut = closing[0]  # the draft that closes the second "b"
    assert row.status == OK and row.accepted_drafts == cut
    assert row.mask_rows == 1 + cut and len(step_masks(res)) == 1 + cut


async def test_replay_goes_through_the_output_check(tok: Tokenizer) -> None:
    _, o = await opened(tok, UNIQUE_STRINGS, replay='["a", "a"')
    assert RpcError.from_status(o.error).reason == "REPLAY_REJECTED"
    s, o = await opened(tok, UNIQUE_STRINGS, replay='["a", "b", "a')
    assert not o.HasField("error")
    res = step(s, "", o.position)
    assert not allowed(step_masks(res)[0], tok.ll.tokenize_str('"')[0])


async def test_a_complete_output_that_does_not_validate_is_not_a_success(tok: Tokenizer) -> None:
    # llguidance checks multipleOf in decimal; jsonschema divides floats (0.3 / 0.1 is not 3).
    tenths = {"type": "number", "multipleOf": 0.1}
    s, _ = await opened(tok, tenths)
    res = step(s, "0.2", 0)
    assert res.rows[0].status == OK and res.rows[0].accepting
    s, _ = await opened(tok, tenths)
    res = step(s, "0.3", 0)  # the grammar lets it through
    err = RpcError.from_status(res.rows[0].error)
    assert err.reason == "CONSTRAINT_UNSATISFIABLE" and "does not validate" in err.message


async def test_a_check_cut_short_still_never_lets_a_violation_through(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(monitor, "LOOKAHEAD_BUDGET_S", -1.0)  # stop after the first candidates
    s, _ = await opened(tok, UNIQUE_STRINGS)
    res = step(s, '["a", "a', 0)
    assert res.rows[0].status == OK
    res = step(s, '"', len(tok.ll.tokenize_str('["a", "a')))  # allowed untried: a duplicate
    err = RpcError.from_status(res.rows[0].error)
    assert err.reason == "CONSTRAINT_UNSATISFIABLE" and "uniqueItems" in err.message
