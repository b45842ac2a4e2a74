"""The Session protocol over real gRPC: replay, desync, drafts, jump-forward, reasoning, per-request
errors, bad input, limits, disconnects, health/reflection/metrics and drain."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import llguidance
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from tests.integration.grammar_service.client import (
    SessionClient,
    allowed,
    channel,
    masks,
    row,
    text_tokens,
)
from tests.support.processes import ServiceProcess, free_port, running

OK = grammar_pb2.ROW_STATUS_OK
DESYNC = grammar_pb2.ROW_STATUS_DESYNC
ERROR = grammar_pb2.ROW_STATUS_ERROR
UNKNOWN = grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TEXT = '{"name": "Ada", "age": 36}'


def schema_constraint(schema: dict[str, object] = SCHEMA) -> common_pb2.Constraint:
    return common_pb2.Constraint(json_schema=json.dumps(schema))


def local_matcher(tok: Tokenizer, schema: dict[str, object] = SCHEMA) -> llguidance.LLMatcher:
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)  # type: ignore[arg-type]
    return llguidance.LLMatcher(tok.ll, g, log_level=0)


def local_mask(m: llguidance.LLMatcher, tok: Tokenizer) -> np.ndarray:
    return np.frombuffer(m.compute_bitmask(), dtype="<i4")[: tok.words_per_row]


@pytest.fixture
def client(gs_channel: grpc.Channel) -> Iterator[SessionClient]:
    c = SessionClient(gs_channel)
    yield c
    c.end()


@pytest.fixture(scope="module")
def limited() -> Iterator[ServiceProcess]:
    metrics_port = free_port()
    with running(
        "grammar-service",
        [
            *("--max-requests", "4", "--max-schema-bytes", "2048"),
            *("--max-rows-per-step", "3", "--max-drafts-per-row", "2"),
            *("--metrics-port", str(metrics_port)),
        ],
    ) as svc:
        svc.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield svc


def rpc_error(fn: object, *args: object) -> RpcError:
    try:
        fn(*args)  # type: ignore[operator]
    except grpc.RpcError as e:
        return RpcError.from_call_error(e)  # type: ignore[arg-type]
    raise AssertionError("expected an error")


# -- replay, desync --------------------------------------------------------------------------


def test_replay_rebuilds_the_state(client: SessionClient, smollm: Tokenizer) -> None:
    toks = text_tokens(smollm, TEXT)
    k = len(toks) // 2
    assert not client.open("a", smollm, schema_constraint()).HasField("error")
    res = client.step([row("a", k, toks[:k])])
    assert res.rows[0].status == OK and res.rows[0].position == k
    opened = client.open("b", smollm, schema_constraint(), replay_tokens=toks[:k])
    assert not opened.HasField("error") and opened.position == k
    res2 = client.step([row("b", k)])
    assert res2.rows[0].status == OK
    np.testing.assert_array_equal(masks(res2)[0], masks(res)[0])
    # Replay of tokens the grammar rejects: the request is not opened.
    bad = client.open("c", smollm, schema_constraint(), replay_tokens=text_tokens(smollm, "[1]"))
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert client.step([row("c", 0)]).rows[0].status == UNKNOWN


def test_desync_is_detected_and_nothing_is_applied(
    client: SessionClient, smollm: Tokenizer
) -> None:
    toks = text_tokens(smollm, TEXT)
    client.open("d", smollm, schema_constraint())
    first = client.step([row("d", 1, toks[:1])])
    assert first.rows[0].status == OK and first.rows[0].position == 1
    # The same message again (a repeat): detected, not applied twice.
    again = client.step([row("d", 1, toks[:1])])
    r = again.rows[0]
    assert r.status == DESYNC and r.expected_position == 2 and r.position == 1 and r.mask_rows == 0
    assert again.bitmask == b""
    # A lost message (the worker skipped a token): detected too.
    lost = client.step([row("d", 3, toks[2:3])])
    assert lost.rows[0].status == DESYNC and lost.rows[0].expected_position == 2
    ok = client.step([row("d", 2, toks[1:2])])
    assert ok.rows[0].status == OK and ok.rows[0].position == 2
    m = local_matcher(smollm)
    assert m.consume_tokens(toks[:2])
    np.testing.assert_array_equal(masks(ok)[0], local_mask(m, smollm))


# -- drafts, jump-forward ---------------------------------------------------------------------


def test_draft_rows_validate_and_mask_each_position(
    client: SessionClient, smollm: Tokenizer
) -> None:
    toks = text_tokens(smollm, TEXT)
    client.open("s", smollm, schema_constraint())
    k = 3
    drafts = toks[k : k + 4]
    wrong = text_tokens(smollm, "]")[0]
    res = client.step([row("s", k, toks[:k], [*drafts, wrong, toks[k + 4]])])
    r = res.rows[0]
    assert r.status == OK and r.accepted_drafts == 4 and r.mask_rows == 5 and r.position == k
    got = masks(res)
    assert got.shape == (5, smollm.words_per_row)
    m = local_matcher(smollm)
    assert m.consume_tokens(toks[:k])
    for i in range(5):
        np.testing.assert_array_equal(got[i], local_mask(m, smollm))
        if i < 4:
            assert allowed(got[i], drafts[i])
            assert m.consume_token(drafts[i])
    assert not allowed(got[4], wrong)
    # Drafts were not consumed: the next row starts from position k.
    nxt = client.step([row("s", k + 1, [toks[k]])])
    assert nxt.rows[0].status == OK and nxt.rows[0].position == k + 1


def test_jump_forward_tokens(client: SessionClient, smollm: Tokenizer) -> None:
    opened = client.open("j", smollm, schema_constraint(), jump_forward=True)
    assert opened.position == 0
    res = client.step([row("j", 0)])
    r = res.rows[0]
    m = local_matcher(smollm)
    ff = list(m.compute_ff_tokens())
    assert ff and list(r.ff_tokens) == ff and r.position == len(ff)
    assert smollm.ll.decode_bytes(ff).startswith(b'{"')
    assert m.consume_tokens(ff)
    np.testing.assert_array_equal(masks(res)[0], local_mask(m, smollm))
    # The worker appends ff tokens itself; its next position counts them.
    nxt_tok = text_tokens(smollm, ' "')[0]
    nxt = client.step([row("j", len(ff) + 1, [nxt_tok])])
    assert m.consume_token(nxt_tok)
    ff2 = list(m.compute_ff_tokens())  # forced again after it (none here: free string content)
    r2 = nxt.rows[0]
    assert r2.status == OK and list(r2.ff_tokens) == ff2
    assert r2.position == len(ff) + 1 + len(ff2)
    # Without jump_forward no ff tokens are returned.
    client.open("nj", smollm, schema_constraint())
    assert list(client.step([row("nj", 0)]).rows[0].ff_tokens) == []


def test_out_of_range_drafts_end_acceptance_without_killing_the_request(
    client: SessionClient, smollm: Tokenizer
) -> None:
    toks = text_tokens(smollm, TEXT)
    k = 3
    client.open("oor", smollm, schema_constraint())
    assert client.step([row("oor", k, toks[:k])]).rows[0].status == OK
    m = local_matcher(smollm)
    assert m.consume_tokens(toks[:k])
    want = [local_mask(m, smollm)]
    for t in toks[k : k + 2]:
        assert m.consume_token(t)
        want.append(local_mask(m, smollm))
    for bad in (smollm.vocab_size, smollm.vocab_size + 5, -1, -(2**31)):
        # Drafts before the bad id are validated; it and every draft after it are not.
        res = client.step([row("oor", k, [], [*toks[k : k + 2], bad, toks[k + 2]])])
        r = res.rows[0]
        assert (r.status, r.accepted_drafts, r.mask_rows, r.position) == (OK, 2, 3, k), (bad, r)
        got = masks(res)
        for i in range(3):
            np.testing.assert_array_equal(got[i], want[i])
    # A bad id as the first draft: nothing accepted, the main row only.
    res = client.step([row("oor", k, [], [smollm.vocab_size + 1, toks[k]])])
    assert (res.rows[0].status, res.rows[0].accepted_drafts, res.rows[0].mask_rows) == (OK, 0, 1)
    # The request is alive and goes on from where it was.
    nxt = client.step([row("oor", k + 1, [toks[k]])])
    assert nxt.rows[0].status == OK and nxt.rows[0].position == k + 1


# -- reasoning ---------------------------------------------------------------------------------


def test_reasoning_rows_are_unconstrained_until_the_marker(
    client: SessionClient, smollm: Tokenizer
) -> None:
    thinking = text_tokens(smollm, "Let me think. </think>")
    marker_end = next(
        i for i in range(len(thinking)) if b"</think>" in smollm.ll.decode_bytes(thinking[: i + 1])
    )
    assert marker_end > 1  # the marker spans several tokens here
    client.open("t", smollm, schema_constraint(), reasoning_end_marker="</think>")
    res = client.step([row("t", 0)])
    assert res.rows[0].mask_rows == 0 and res.bitmask == b""
    res = client.step([row("t", marker_end, thinking[:marker_end])])
    assert res.rows[0].mask_rows == 0  # the marker is not complete yet
    # Drafts during reasoning: accepted up to, not including, the one completing the marker.
    res = client.step([row("t", marker_end, [], thinking[marker_end:])])
    assert res.rows[0].accepted_drafts == 0 and res.rows[0].mask_rows == 0
    res = client.step([row("t", marker_end + 1, thinking[marker_end : marker_end + 1])])
    r = res.rows[0]
    assert r.status == OK and r.mask_rows == 1
    np.testing.assert_array_equal(masks(res)[0], local_mask(local_matcher(smollm), smollm))
    # Tokens after the marker are constrained: free text is now rejected.
    bad = client.step([row("t", marker_end + 2, text_tokens(smollm, "x"))])
    assert bad.rows[0].status == ERROR


def test_replay_through_a_reasoning_gate(client: SessionClient, smollm: Tokenizer) -> None:
    """Re-opening a request that was reasoning (the worker's failover): the replayed tokens go
    through the gate first; only those after the marker reach the grammar."""
    thinking = text_tokens(smollm, "Let me think. [1, 2] </think>")  # free text, not JSON
    toks = text_tokens(smollm, TEXT)
    k = len(toks) // 2
    marker = "</think>"
    # Past the marker: the grammar state is that of the constrained tokens alone.
    opened = client.open(
        "rr",
        smollm,
        schema_constraint(),
        reasoning_end_marker=marker,
        replay_tokens=thinking + toks[:k],
    )
    assert not opened.HasField("error") and opened.position == len(thinking) + k, opened
    res = client.step([row("rr", len(thinking) + k)])
    assert res.rows[0].status == OK and res.rows[0].mask_rows == 1
    m = local_matcher(smollm)
    assert m.consume_tokens(toks[:k])
    np.testing.assert_array_equal(masks(res)[0], local_mask(m, smollm))
    # Still inside the reasoning part: unconstrained until the rest of the marker arrives.
    inside = len(thinking) - 1
    opened = client.open(
        "ri",
        smollm,
        schema_constraint(),
        reasoning_end_marker=marker,
        replay_tokens=thinking[:inside],
    )
    assert not opened.HasField("error") and opened.position == inside
    assert client.step([row("ri", inside)]).rows[0].mask_rows == 0
    res = client.step([row("ri", len(thinking), thinking[inside:])])
    assert res.rows[0].status == OK and res.rows[0].mask_rows == 1
    np.testing.assert_array_equal(masks(res)[0], local_mask(local_matcher(smollm), smollm))
    # Tokens after the marker that the grammar rejects: the request is not opened.
    bad = client.open(
        "rb",
        smollm,
        schema_constraint(),
        reasoning_end_marker=marker,
        replay_tokens=thinking + text_tokens(smollm, "[1]"),
    )
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert RpcError.from_status(bad.error).reason == "REPLAY_REJECTED"
    assert client.step([row("rb", 0)]).rows[0].status == UNKNOWN


# -- per-request errors -----------------------------------------------------------------------


def test_one_bad_row_never_spoils_the_others(client: SessionClient, smollm: Tokenizer) -> None:
    toks = text_tokens(smollm, TEXT)
    for rid in ("h1", "bad", "h2", "range"):
        client.open(rid, smollm, schema_constraint())
    rejected = text_tokens(smollm, "[")[0]
    res = client.step(
        [
            row("h1", 1, toks[:1]),
            row("bad", 1, [rejected]),
            row("ghost", 0),
            row("h2", 2, toks[:2]),
            row("range", 1, [smollm.vocab_size + 5]),
            row("h1", 1, []),
        ]
    )
    st = [r.status for r in res.rows]
    assert st == [OK, ERROR, UNKNOWN, OK, ERROR, ERROR]
    assert "out of range" in res.rows[4].error.message
    assert "more than once" in res.rows[5].error.message
    assert res.rows[1].error.message
    got = masks(res)
    assert got.shape[0] == 2
    for k, n in ((0, 1), (1, 2)):
        m = local_matcher(smollm)
        assert m.consume_tokens(toks[:n])
        np.testing.assert_array_equal(got[k], local_mask(m, smollm))
    # The dead request stays dead until closed; healthy ones carry on.
    res = client.step([row("bad", 1), row("h1", 2, toks[1:2])])
    assert [r.status for r in res.rows] == [ERROR, OK]
    assert client.close("bad").found and not client.close("bad").found


def test_finished_and_accepting_flags(client: SessionClient, smollm: Tokenizer) -> None:
    c = common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["yes", "no"]))
    client.open("y", smollm, c)
    toks = text_tokens(smollm, "yes")
    res = client.step([row("y", len(toks), toks)])
    r = res.rows[0]
    assert r.accepting and r.finished
    only = np.flatnonzero(np.unpackbits(masks(res)[0].view(np.uint8), bitorder="little"))
    assert list(only) == list(smollm.eos_token_ids)
    res = client.step([row("y", len(toks) + 1, [smollm.eos_token_ids[0]])])
    assert res.rows[0].status == OK


# -- constraint kinds and bad input ------------------------------------------------------------


def test_compile_every_kind_and_cache(gs_channel: grpc.Channel, smollm: Tokenizer) -> None:
    stub = grammar_pb2_grpc.GrammarServiceStub(gs_channel)
    gbnf = 'root ::= "a" [0-9]+ ws\nws ::= [ \\t]*\n'
    tags = common_pb2.StructuralTags(
        triggers=["<tool_call>"],
        tags=[
            common_pb2.StructuralTag(
                begin='<tool_call>{"name": "get_weather", "arguments": ',
                json_schema=json.dumps(
                    {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    }
                ),
                end="}</tool_call>",
            )
        ],
    )
    kinds = [
        common_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
        common_pb2.Constraint(json_object=True),
        common_pb2.Constraint(regex=r"\d{3}"),
        common_pb2.Constraint(lark='start: "x" /[a-z]+/'),
        common_pb2.Constraint(gbnf=gbnf),
        common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["a", "b"])),
        common_pb2.Constraint(structural_tags=tags),
    ]
    ids = []
    for c in kinds:
        first = stub.Compile(grammar_pb2.CompileRequest(constraint=c))
        again = stub.Compile(
            grammar_pb2.CompileRequest(constraint=c, tokenizer=smollm.fingerprint.to_proto())
        )
        assert first.grammar_id == again.grammar_id and again.cached and again.compile_ms == 0
        ids.append(first.grammar_id)
    assert len(set(ids)) == len(kinds)
    # Options are part of the key: the same schema with flexible whitespace is another grammar,
    # and the cache hands back the one that was asked for (a space after `{` only in the second).
    flex = common_pb2.Constraint(
        json_schema=json.dumps(SCHEMA),
        json_options=common_pb2.JsonOptions(whitespace_flexible=True),
    )
    flex_id = stub.Compile(grammar_pb2.CompileRequest(constraint=flex)).grammar_id
    assert flex_id != ids[0]
    again = stub.Compile(grammar_pb2.CompileRequest(constraint=flex))
    assert again.cached and again.grammar_id == flex_id
    brace_space = text_tokens(smollm, "{ ")
    c = SessionClient(gs_channel)
    try:
        for rid, gid, ok in (("compact", ids[0], False), ("flex", flex_id, True)):
            assert not c.open(rid, smollm, grammar_id=gid).HasField("error")
            res = c.step([row(rid, len(brace_space), brace_space)])
            assert (res.rows[0].status == OK) is ok, (rid, res.rows[0])
    finally:
        c.end()


def test_structural_tags_accept_free_text_and_a_tool_call(
    client: SessionClient, smollm: Tokenizer
) -> None:
    tags = common_pb2.StructuralTags(
        triggers=["<tool_call>"],
        tags=[
            common_pb2.StructuralTag(
                begin='<tool_call>{"name": "get_weather", "arguments": ',
                json_schema=json.dumps(
                    {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    }
                ),
                end="}</tool_call>",
            )
        ],
    )
    client.open("st", smollm, common_pb2.Constraint(structural_tags=tags))
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    toks = text_tokens(smollm, text)
    res = client.step([row("st", len(toks), toks)])
    assert res.rows[0].status == OK and res.rows[0].accepting
    client.open("st2", smollm, common_pb2.Constraint(structural_tags=tags))
    bad = text_tokens(smollm, '<tool_call>{"name": "get_weather", "arguments": {"town": 1}}')
    assert client.step([row("st2", len(bad), bad)]).rows[0].status == ERROR


@pytest.mark.parametrize(
    ("constraint", "field", "needle"),
    [
        (common_pb2.Constraint(json_schema='{"type": "strin"}'), "constraint.json_schema", "strin"),
        (
            common_pb2.Constraint(json_schema='{"type": "object",'),
            "constraint.json_schema",
            "line 1 column",
        ),
        (common_pb2.Constraint(json_schema="false"), "constraint.json_schema", "false"),
        (common_pb2.Constraint(regex="a(b"), "constraint.regex", "unclosed group"),
        (common_pb2.Constraint(lark="start: foo"), "constraint.lark", "foo"),
        (common_pb2.Constraint(gbnf="root ::= ("), "constraint.gbnf", ""),
        (
            common_pb2.Constraint(choice=common_pb2.ChoiceList()),
            "constraint.choice.choices",
            "at least one",
        ),
        (common_pb2.Constraint(), "constraint", "one of"),
    ],
)
def test_bad_constraints_name_the_field(
    gs_channel: grpc.Channel, constraint: common_pb2.Constraint, field: str, needle: str
) -> None:
    stub = grammar_pb2_grpc.GrammarServiceStub(gs_channel)
    err = rpc_error(stub.Compile, grammar_pb2.CompileRequest(constraint=constraint))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.violations and err.violations[0][0] == field, err.violations
    assert needle in err.violations[0][1]
    assert "Traceback" not in err.message


def test_bad_open_requests(
    client: SessionClient, smollm: Tokenizer, gs_channel: grpc.Channel
) -> None:
    other = common_pb2.TokenizerFingerprint(
        vocab_size=7, tokens_sha256=b"x" * 32, eos_token_ids=[0]
    )
    msg = grammar_pb2.Open(request_id="fp", constraint=schema_constraint(), tokenizer=other)
    opened = client.send(grammar_pb2.SessionRequest(open=msg)).opened
    assert opened.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "tokenizer mismatch" in opened.error.message
    stub = grammar_pb2_grpc.GrammarServiceStub(gs_channel)
    err = rpc_error(
        stub.Compile, grammar_pb2.CompileRequest(constraint=schema_constraint(), tokenizer=other)
    )
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    unknown = client.open("gid", smollm, grammar_id="0" * 32)
    assert unknown.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    bad_schema = client.open("bs", smollm, common_pb2.Constraint(json_schema='{"type": 5}'))
    assert bad_schema.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert client.open("dup", smollm, schema_constraint()).error.code == 0
    assert (
        client.open("dup", smollm, schema_constraint()).error.code
        == grpc.StatusCode.ALREADY_EXISTS.value[0]
    )
    assert not client.close("nope").found
    # The stream survived all of it.
    assert client.step([row("dup", 0)]).rows[0].status == OK


# -- limits, disconnects, health, metrics, drain -----------------------------------------------


def test_oversize_schema_and_request_limit_and_disconnect(
    limited: ServiceProcess, smollm: Tokenizer
) -> None:
    ch = channel(limited.address)
    stub = grammar_pb2_grpc.GrammarServiceStub(ch)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    err = rpc_error(stub.Compile, grammar_pb2.CompileRequest(constraint=schema_constraint(big)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "2048" in err.violations[0][1]

    a = SessionClient(ch)
    for i in range(4):
        assert not a.open(f"r{i}", smollm, schema_constraint()).HasField("error")
    full = a.open("r4", smollm, schema_constraint())
    assert full.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-requests" in full.error.message
    a._responses.cancel()  # type: ignore[attr-defined]  # the client goes away without closing
    b = SessionClient(ch)
    deadline = time.monotonic() + 10
    while True:  # the server notices the cancellation asynchronously
        opened = b.open("x0", smollm, schema_constraint())
        if not opened.HasField("error") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not opened.HasField("error"), opened.error
    for i in range(1, 4):
        assert not b.open(f"x{i}", smollm, schema_constraint()).HasField("error")
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{limited.metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )  # type: ignore[attr-defined]
    assert "maskwire_grammar_live_requests 4.0" in text
    assert "maskwire_grammar_compile_seconds_count" in text
    b.end()
    ch.close()


def test_small_steps_are_answered_dense_by_default(
    limited: ServiceProcess, smollm: Tokenizer
) -> None:
    """`compact_masks` lets the service choose; below --compact-min-rows (16) it sends dense."""
    with channel(limited.address) as ch:
        c = SessionClient(ch)
        c.open("small", smollm, schema_constraint())
        res = c.step([row("small", 0)], compact=True)
        assert not res.mask_row_encodings and len(res.bitmask) == smollm.words_per_row * 4
        np.testing.assert_array_equal(masks(res)[0], local_mask(local_matcher(smollm), smollm))
        c.close("small")
        c.end()


def _wait_no_live_requests(svc: ServiceProcess, timeout_s: float = 10.0) -> None:
    """Streams of earlier tests end asynchronously: wait until the service holds no request."""
    url = f"http://127.0.0.1:{svc.metrics_port}/metrics"  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while (
        "maskwire_grammar_live_requests 0.0"
        not in urllib.request.urlopen(url, timeout=5).read().decode()
    ):
        assert time.monotonic() < deadline, "requests of earlier tests are still live"
        time.sleep(0.05)


def test_max_drafts_per_row_truncates_the_drafts(
    limited: ServiceProcess, smollm: Tokenizer
) -> None:
    """--max-drafts-per-row 2: drafts past the second are ignored, never validated."""
    _wait_no_live_requests(limited)
    toks = text_tokens(smollm, TEXT)
    with channel(limited.address) as ch:
        c = SessionClient(ch)
        try:
            assert not c.open("d", smollm, schema_constraint()).HasField("error")
            res = c.step([row("d", 2, toks[:2], toks[2:7])])  # five valid drafts
            r = res.rows[0]
            assert (r.status, r.accepted_drafts, r.mask_rows, r.position) == (OK, 2, 3, 2), r
            m = local_matcher(smollm)
            assert m.consume_tokens(toks[:2])
            got = masks(res)
            assert got.shape == (3, smollm.words_per_row)
            for i in range(3):
                np.testing.assert_array_equal(got[i], local_mask(m, smollm))
                if i < 2:
                    assert m.consume_token(toks[2 + i])
        finally:
            c.end()


def test_max_rows_per_step_refuses_a_larger_step(
    limited: ServiceProcess, smollm: Tokenizer
) -> None:
    """--max-rows-per-step 3: a Step with 4 rows ends the stream with INVALID_ARGUMENT naming the
    flag; 3 rows are answered. The stream's requests are freed."""
    _wait_no_live_requests(limited)
    with channel(limited.address) as ch:
        c = SessionClient(ch)
        for rid in ("a", "b", "c"):
            assert not c.open(rid, smollm, schema_constraint()).HasField("error")
        ok = c.step([row(rid, 0) for rid in ("a", "b", "c")])
        assert [r.status for r in ok.rows] == [OK, OK, OK] and len(masks(ok)) == 3
        with pytest.raises(grpc.RpcError) as info:
            c.step([row(rid, 0) for rid in ("a", "b", "c", "a")])
        err = RpcError.from_call_error(info.value)  # type: ignore[arg-type]
        assert err.code is grpc.StatusCode.INVALID_ARGUMENT, err.message
        assert "--max-rows-per-step" in err.message and err.violations[0][0] == "step.rows"
        c.end()
    _wait_no_live_requests(limited)


def test_health_and_reflection(grammar_service: ServiceProcess, gs_channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(gs_channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="maskwire.v1.GrammarService"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(gs_channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "maskwire.v1.GrammarService" in names and "grpc.health.v1.Health" in names


def test_drain_finishes_the_stream_and_exits_cleanly(smollm: Tokenizer) -> None:
    svc = ServiceProcess("grammar-service", [], free_port())
    try:
        svc.wait_ready()
        ch = channel(svc.address)
        c = SessionClient(ch)
        c.open("q", smollm, schema_constraint())
        assert c.step([row("q", 0)]).rows[0].status == OK
        svc.kill(signal.SIGTERM)
        # Steps already sent are answered; once the service has seen the signal the stream ends.
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(1000):
                assert c.step([row("q", 0)]).rows[0].status == OK
                time.sleep(0.01)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        ch.close()
        assert svc.proc.wait(30) == 0, svc.log_text()
    finally:
        assert svc.stop() == 0, svc.log_text()
