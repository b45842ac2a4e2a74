"""Forced drafts: with `StepRow.forced_draft_room`, a row that gets jump-forward tokens also gets
drafts of the bytes the grammar forces after them but cannot tokenize yet, in place of its own
drafts; a row whose drafts all pass and end where the grammar forces bytes (a closed JSON string)
gets them extended by those bytes' tokens. The grammar consumes none of them."""

from __future__ import annotations

import json

import pytest

from grammar_service.config import Limits
from grammar_service.session import Session
from maskwire.bitmask import step_masks
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from tests.unit.grammar_service.schema_support import allowed
from tests.unit.grammar_service.test_session import runtime

OK = grammar_pb2.ROW_STATUS_OK
RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


async def opened(
    tok: Tokenizer, jump_forward: bool = True, limits: Limits | None = None
) -> Session:
    rt = runtime(tok)
    if limits is not None:
        rt.limits = limits
    s = Session(rt)
    o = await s.open(
        grammar_pb2.Open(
            request_id="r",
            constraint=common_pb2.Constraint(json_schema=json.dumps(RECORD)),
            tokenizer=tok.fingerprint.to_proto(),
            options=grammar_pb2.RequestOptions(jump_forward=jump_forward),
        )
    )
    assert not o.HasField("error")
    return s


def step(
    s: Session, new: list[int], position: int, drafts: list[int], room: int
) -> grammar_pb2.StepResult:
    row = grammar_pb2.StepRow(
        request_id="r",
        new_tokens=new,
        position=position + len(new),
        draft_tokens=drafts,
        forced_draft_room=room,
    )
    return s.step(grammar_pb2.Step(step=1, rows=[row]))


def spelled(tok: Tokenizer, tokens: list[int]) -> bytes:
    return b"".join(tok.token_bytes(t) for t in tokens)


async def test_forced_tokens_come_with_drafts_of_what_is_forced_after_them(tok: Tokenizer) -> None:
    s = await opened(tok)
    worker_drafts = tok.encode("Maria")  # drafted before the worker knew what is forced
    res = step(s, [], 0, worker_drafts, room=4)
    row = res.rows[0]
    assert row.status == OK
    assert spelled(tok, list(row.ff_tokens)) == b'{"name":'
    # ` "` is forced too, but a longer token could start with it: a draft, not a forced token.
    assert spelled(tok, list(row.forced_drafts)) == b' "'
    assert row.accepted_drafts == 1 and row.mask_rows == 2
    masks = step_masks(res)
    quote = tok.encode(' "')[0]
    maria = tok.encode("Maria")[0]
    # The main row is for the position after the forced tokens, the next after the draft.
    assert allowed(masks[0], quote) and not allowed(masks[0], maria)
    assert allowed(masks[1], maria)
    # Not consumed: the position counts the forced tokens only, and the worker sends the draft
    # back as a new token once verification accepted it.
    assert row.position == len(row.ff_tokens)
    value = [quote, *tok.encode('Maria",')]
    res = step(s, value, row.position, [], room=4)
    row2 = res.rows[0]
    assert row2.status == OK
    assert spelled(tok, list(row2.ff_tokens)) == b' "city":'
    assert spelled(tok, list(row2.forced_drafts)) == b' "'


async def test_without_room_or_forced_tokens_the_row_keeps_its_own_drafts(tok: Tokenizer) -> None:
    s = await opened(tok)
    quote = tok.encode(' "')[0]
    res = step(s, [], 0, [quote], room=0)
    row = res.rows[0]
    assert not row.forced_drafts and row.accepted_drafts == 1  # the worker's own ` "`, checked
    ff = list(row.ff_tokens)
    name = tok.encode("Maria")
    # No forced tokens after ` "`: the worker's drafts are checked as usual, room or not.
    res = step(s, [quote], len(ff), name, room=4)
    row = res.rows[0]
    assert not row.ff_tokens and not row.forced_drafts
    assert row.accepted_drafts == len(name) and row.mask_rows == 1 + len(name)


async def test_forced_drafts_never_exceed_the_room(tok: Tokenizer) -> None:
    s = Session(runtime(tok))
    long_value = "lorem ipsum dolor " * 200  # a long literal the grammar forces
    o = await s.open(
        grammar_pb2.Open(
            request_id="r",
            constraint=common_pb2.Constraint(json_schema=json.dumps({"const": long_value})),
            tokenizer=tok.fingerprint.to_proto(),
            options=grammar_pb2.RequestOptions(jump_forward=True),
        )
    )
    assert not o.HasField("error")
    row = step(s, [], 0, [], room=2).rows[0]
    assert row.status == OK and row.ff_tokens
    assert len(row.forced_drafts) <= 2 and row.mask_rows == 1 + row.accepted_drafts
    forced = spelled(tok, list(row.ff_tokens)) + spelled(tok, list(row.forced_drafts))
    assert json.dumps(long_value).encode().startswith(forced)


async def test_drafts_that_close_a_string_get_what_the_grammar_forces_after_it(
    tok: Tokenizer,
) -> None:
    """The worker's drafts ` Gonzalez"` end the value: the service re-tokenizes the closing quote
    with the forced `, "city": "` as the model writes it (`",`), adds the tokens jump-forward
    would force after it (` "city":`, marked as such) and a draft of the rest (` "`), all
    checked and none consumed. A step that gets those tokens one by one, without drafts, ends
    in the same state with the same forced tokens."""
    s = await opened(tok)
    ff = list(step(s, [], 0, [], room=0).rows[0].ff_tokens)
    head = [tok.encode(' "')[0], *tok.encode("Maria")]
    own = tok.encode(' Gonzalez"')
    res = step(s, head, len(ff), own, room=8)
    row = res.rows[0]
    assert row.status == OK
    drafts = list(row.forced_drafts)
    assert spelled(tok, drafts) == b' Gonzalez", "city": "'
    assert drafts[: len(own) - 1] == own[:-1] and spelled(tok, [drafts[len(own) - 1]]) == b'",'
    start, count = row.forced_jump_start, row.forced_jump_count
    assert start == len(own) and spelled(tok, drafts[start : start + count]) == b' "city":'
    assert row.accepted_drafts == len(drafts) and row.mask_rows == 1 + len(drafts)
    assert row.position == len(ff) + len(head)  # the drafts are not consumed
    masks = step_masks(res)
    assert all(allowed(masks[j], t) for j, t in enumerate(drafts))  # row j: draft j's position

    # The same tokens without speculation: sampled up to `",`, then jump-forward.
    plain = await opened(tok)
    step(plain, [], 0, [], room=0)
    sampled = [*head, *drafts[:start]]
    row2 = step(plain, sampled, len(ff), [], room=8).rows[0]
    assert list(row2.ff_tokens) == drafts[start : start + count]
    assert list(row2.forced_drafts) == drafts[start + count :]
    # And the speculating session, told the accepted drafts, is where the plain one is.
    row3 = step(s, drafts, len(ff) + len(head), [], room=0).rows[0]
    assert row3.status == OK and row3.position == row2.position + len(row2.forced_drafts)


async def test_without_jump_forward_the_forced_bytes_are_all_drafts(tok: Tokenizer) -> None:
    s = await opened(tok, jump_forward=False)
    head = [*tok.encode('{"name": "'), *tok.encode("Maria")]
    own = tok.encode(' Gonzalez"')
    row = step(s, head, 0, own, room=8).rows[0]
    assert row.status == OK and row.forced_jump_count == 0
    assert spelled(tok, list(row.forced_drafts)) == b' Gonzalez", "city": "'


async def test_no_tail_after_a_rejected_draft_or_without_room_for_the_forced_tokens(
    tok: Tokenizer,
) -> None:
    s = await opened(tok)
    ff = list(step(s, [], 0, [], room=0).rows[0].ff_tokens)
    head = [tok.encode(' "')[0], *tok.encode("Maria")]
    step(s, head, len(ff), [], room=0)
    at = len(ff) + len(head)
    newline = tok.encode("\n")  # not allowed raw inside a JSON string
    rejected = [*tok.encode(" Gonzalez"), *newline, *tok.encode('"')]
    row = step(s, [], at, rejected, room=8).rows[0]
    assert row.accepted_drafts == len(tok.encode(" Gonzalez")) and not row.forced_drafts
    own = tok.encode(' Gonzalez"')
    row = step(s, [], at, own, room=2).rows[0]  # ` "city":` is three forced tokens
    assert row.accepted_drafts == len(own) and not row.forced_drafts


async def test_no_drafts_looked_at_means_no_tail(tok: Tokenizer) -> None:
    """`--max-drafts-per-row 0`: the service looks at no draft, so nothing is extended, even
    where the grammar forces bytes (jump-forward off: after `",` the next key is forced)."""
    s = await opened(tok, jump_forward=False, limits=Limits(max_drafts_per_row=0))
    head = [*tok.encode('{"name": "'), *tok.encode('Maria",')]
    row = step(s, head, 0, tok.encode(' "city'), room=8).rows[0]
    assert row.status == OK and row.accepted_drafts == 0 and not row.forced_drafts
