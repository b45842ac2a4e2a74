"""The catalogue of bad inputs: each case says what it sends to which API and the exact answer.

Three APIs: the gateway's REST API (`HttpCase`), the worker's `Generate` (`WorkerCase`) and the
grammar service's `Compile` / `Session` (`GrammarCase`). Cases that need a conversation (a client
that vanishes mid-stream, a duplicate live request id, a `$ref` to a server that counts hits) are
`ActionCase`s naming a scenario in `test_catalogue.py` (or in `hostile_schemas.SCENARIOS`). After every case the test checks that all
three services are healthy, still answer known-good requests, and hold no leftover state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from grammar_service.config import Limits
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, worker_pb2
from tests.robustness.stack import MAX_SEQ_LEN, MODEL

ANY = object()  # "don't check this field"
BIG = 70 * 1024 * 1024  # over every service's 64 MiB gRPC message limit
VOCAB = 49_152


def chat(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    body.update(extra)
    return body


def schema_body(schema: Any) -> dict[str, Any]:
    return chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )


def nested_schema_text(depth: int) -> str:
    """`{"type":"array","items": ... {}}` nested `depth` times, as raw JSON text."""
    return '{"type":"array","items":' * depth + "{}" + "}" * depth


def raw_chat_with_schema(schema_text: str) -> bytes:
    head = json.dumps(chat())[:-1]
    rf = '{"type":"json_schema","json_schema":{"name":"x","schema":' + schema_text + "}}"
    return f'{head}, "response_format": {rf}}}'.encode()


def five_mb_schema() -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(40_000)}
    return {"type": "object", "properties": props}


# -- gateway (HTTP) ------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpCase:
    name: str
    body: Any  # dict/list: sent as JSON; bytes: sent as they are
    status: int
    code: Any = ANY  # error.code
    param: Any = ANY  # error.param
    message: str = ""  # a substring of error.message
    path: str = "/v1/chat/completions"
    method: str = "POST"
    content_type: str = "application/json"
    check: Callable[[dict[str, Any]], None] | None = None  # for 200 answers
    xfail: str = ""


def _content_matches(pattern: str, *, finishes: bool = False) -> Callable[[dict[str, Any]], None]:
    """The answer is in the language of `pattern`; an answer cut off by `max_tokens` is a
    non-empty prefix of one (the `regex` package's partial matching: an independent reference).
    `finishes`: the case has tokens enough to end, so `length` is a failure."""
    import regex

    compiled = regex.compile(pattern)

    def check(body: dict[str, Any]) -> None:
        choice = body["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert compiled.fullmatch(text), text
        else:
            assert not finishes and choice["finish_reason"] == "length", choice
            assert text and compiled.fullmatch(text, partial=True), text

    return check


def _finished(body: dict[str, Any]) -> None:
    assert body["choices"][0]["finish_reason"] in ("stop", "length"), body


SCHEMA_PARAM = "response_format.json_schema.schema"

HTTP_CASES: list[HttpCase] = [
    # malformed bodies
    HttpCase("malformed-json", b'{"model": ', 422, "invalid_body"),
    HttpCase("body-is-array", [], 422, "invalid_body"),
    HttpCase("body-is-string", "hello", 422, "invalid_body"),
    HttpCase("not-json-content-type", json.dumps(chat()).encode(), 422, content_type="text/plain"),
    # An undecodable body (not UTF-8) is refused before validation.
    HttpCase(
        "invalid-utf8-body",
        json.dumps(chat()).encode().replace(b"Say", b"S\xff\xfey"),
        400,
        message="error parsing the body",
    ),
    HttpCase(
        "deeply-nested-body", raw_chat_with_schema(nested_schema_text(5000)), 400, message="body"
    ),
    HttpCase("body-over-limit", b"x" * (9 * 1024 * 1024), 413, "request_too_large"),
    # wrong types in every field
    HttpCase("model-not-string", chat(model=5), 422, "invalid_body", "model"),
    HttpCase("messages-not-list", chat(messages="hi"), 422, "invalid_body", "messages"),
    HttpCase("messages-empty", chat(messages=[]), 422, "invalid_body", "messages"),
    HttpCase(
        "role-unknown",
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        422,
        "invalid_body",
        "messages.0.role",
    ),
    HttpCase(
        "content-not-text", chat(messages=[{"role": "user", "content": 5}]), 422, "invalid_body"
    ),
    HttpCase("temperature-string", chat(temperature="hot"), 422, "invalid_body", "temperature"),
    HttpCase("temperature-too-high", chat(temperature=5), 422, "invalid_body", "temperature"),
    HttpCase("top-p-zero", chat(top_p=0), 422, "invalid_body", "top_p"),
    HttpCase(
        "seed-not-finite",
        json.dumps(chat()).replace('"temperature": 0', '"seed": 1e400').encode(),
        422,
        "invalid_body",
        "seed",
    ),
    HttpCase("stop-wrong-type", chat(stop=5), 422, "invalid_body"),
    HttpCase("stream-wrong-type", chat(stream=[1]), 422, "invalid_body", "stream"),
    HttpCase("max-tokens-zero", chat(max_tokens=0), 422, "invalid_body", "max_tokens"),
    HttpCase("max-tokens-negative", chat(max_tokens=-1), 422, "invalid_body", "max_tokens"),
    HttpCase("max-tokens-string", chat(max_tokens="many"), 422, "invalid_body", "max_tokens"),
    HttpCase(
        "tool-name-invalid",
        chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        422,
        "invalid_body",
        "tools.0.function.name",
    ),
    HttpCase(
        "schema-not-object",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}),
        422,
        "invalid_body",
    ),
    # huge values that are still meaningful: clamped, answered
    HttpCase(
        "max-tokens-huge",
        chat(max_tokens=2**40, structured_outputs={"choice": ["yes", "no"]}),
        200,
        check=_content_matches("yes|no", finishes=True),
    ),
    HttpCase("top-k-huge", chat(top_k=2**40), 200, check=_finished),
    # unsupported / unknown
    HttpCase("unknown-model", chat(model="gpt-17"), 404, "model_not_found", "model"),
    HttpCase(
        "unknown-model-card", None, 404, "model_not_found", path="/v1/models/gpt-17", method="GET"
    ),
    HttpCase("unknown-path", chat(), 404, path="/v1/embeddings"),
    HttpCase("n-over-the-limit", chat(n=100), 400, param="n", message="at most"),
    HttpCase(
        "top-logprobs-over-20",
        chat(logprobs=True, top_logprobs=21),
        400,
        param="top_logprobs",
        message="must be in [0, 20]",
    ),
    HttpCase("top-logprobs-without-logprobs", chat(top_logprobs=3), 400, param="top_logprobs"),
    HttpCase("too-many-stops", chat(stop=list("abcde")), 400, param="stop"),
    HttpCase(
        "prompt-longer-than-context",
        chat(messages=[{"role": "user", "content": "hello " * (MAX_SEQ_LEN * 2)}]),
        400,
        "invalid_request",
        "prompt",
        message="tokens; the limit is",
    ),
    HttpCase(
        "ignore-eos-with-constraint",
        chat(ignore_eos=True, structured_outputs={"regex": "a+"}),
        400,
        "invalid_request",
        "sampling.ignore_eos",
    ),
    HttpCase(
        "tool-choice-not-in-tools",
        chat(
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        param="tool_choice",
    ),
    # schemas: invalid, self-contradictory, unsupported, refs, nested, huge
    HttpCase(
        "schema-bad-type",
        schema_body({"type": "nonsense"}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
    ),
    HttpCase(
        "schema-min-over-max-length",
        schema_body({"type": "string", "minLength": 5, "maxLength": 2}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
        message="Unsatisfiable",
    ),
    HttpCase(
        "schema-min-over-max",
        schema_body({"type": "integer", "minimum": 5, "maximum": 3}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
    ),
    HttpCase(
        "schema-allof-contradiction",
        schema_body({"allOf": [{"type": "string"}, {"type": "integer"}]}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
    ),
    HttpCase(
        "schema-unsupported-keyword-strict-mode",
        {
            **schema_body({"type": "string", "if": {"type": "string"}, "then": {"minLength": 2}}),
            "schema_mode": "strict",  # complete mode (the default) takes it
        },
        400,
        "unsupported_constraint",
        SCHEMA_PARAM,
        message="if",
    ),
    HttpCase(
        "schema-unresolvable-ref",
        schema_body({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
    ),
    HttpCase(
        "schema-deeply-nested",
        raw_chat_with_schema(nested_schema_text(900)),
        400,
        param=SCHEMA_PARAM,
        message="nested deeper than",  # the gateway's --max-json-depth
    ),
    HttpCase(
        "schema-5mb",
        schema_body(five_mb_schema()),
        400,
        "constraint_too_large",
        SCHEMA_PARAM,
    ),
    HttpCase(
        "schema-text-not-json",
        chat(structured_outputs={"json": "{not json"}),
        400,
        param="structured_outputs.json",
    ),
    # regexes and grammars
    HttpCase(
        "regex-nested-quantifier",
        chat(structured_outputs={"regex": "(a+)+$"}),
        200,
        check=_content_matches("(a+)+"),
    ),
    HttpCase(
        "regex-exponential-dfa",
        chat(structured_outputs={"regex": "[ab]*a[ab]{30}"}),
        200,
        check=_content_matches("[ab]*a[ab]{30}"),
    ),
    HttpCase(
        "regex-huge-repetition",
        chat(structured_outputs={"regex": "(((a{1,1000}){1,1000}){1,1000})"}),
        200,
        check=_content_matches("a+"),
    ),
    HttpCase(
        "regex-empty-language",
        chat(structured_outputs={"regex": r"[^\x00-\x{10FFFF}]"}),
        400,
        "empty_language",
        "structured_outputs.regex",
    ),
    HttpCase(
        "regex-unclosed-class",
        chat(structured_outputs={"regex": "["}),
        400,
        "invalid_constraint",
        "structured_outputs.regex",
    ),
    HttpCase(
        "lark-unknown-rule",
        chat(structured_outputs={"grammar": "start: foo"}),
        400,
        "invalid_constraint",
        "structured_outputs.grammar",
    ),
    HttpCase(
        "choice-empty",
        chat(structured_outputs={"choice": []}),
        400,
        param="structured_outputs.choice",
    ),
    HttpCase(
        "two-constraints",
        chat(structured_outputs={"regex": "a", "choice": ["a"]}),
        400,
        param="structured_outputs",
    ),
]

# -- worker (gRPC Generate) ----------------------------------------------------------------


@dataclass(frozen=True)
class WorkerCase:
    name: str
    request: worker_pb2.GenerateRequest | bytes  # bytes: sent as they are (not a valid message)
    code: grpc.StatusCode
    reason: str = ""
    field: str = ""  # the first BadRequest field violation
    xfail: str = ""


def gen(
    text: str = "Hi", constraint: common_pb2.Constraint | None = None, **kw: Any
) -> worker_pb2.GenerateRequest:
    kw.setdefault("max_tokens", 2)
    req = worker_pb2.GenerateRequest(text=text, sampling=worker_pb2.SamplingParams(**kw))
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    return req


def ids(*tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        token_ids=worker_pb2.TokenIds(ids=list(tokens)),
        sampling=worker_pb2.SamplingParams(max_tokens=2),
    )


def _raw_field(number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field, written by hand (to send invalid UTF-8)."""
    n, varint = len(data), b""
    while True:
        low, n = n & 0x7F, n >> 7
        varint += bytes([low | (0x80 if n else 0)])
        if not n:
            break
    return bytes([(number << 3) | 2]) + varint + data


C = common_pb2.Constraint
IA = grpc.StatusCode.INVALID_ARGUMENT

WORKER_CASES: list[WorkerCase] = [
    WorkerCase(
        "unknown-model",
        worker_pb2.GenerateRequest(text="Hi", model="gpt-17"),
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        "model",
    ),
    WorkerCase("token-id-over-vocab", ids(1, VOCAB), IA, field="token_ids.ids"),
    WorkerCase("token-id-negative", ids(-5), IA, field="token_ids.ids"),
    WorkerCase("empty-prompt", worker_pb2.GenerateRequest(), IA, field="prompt"),
    WorkerCase("prompt-longer-than-context", gen("hello " * (MAX_SEQ_LEN * 2)), IA, field="prompt"),
    WorkerCase("temperature-nan", gen(temperature=float("nan")), IA, field="sampling.temperature"),
    WorkerCase("temperature-negative", gen(temperature=-1), IA, field="sampling.temperature"),
    WorkerCase("top-p-over-one", gen(top_p=5), IA, field="sampling.top_p"),
    WorkerCase(
        "stop-token-out-of-range", gen(stop_token_ids=[10**6]), IA, field="sampling.stop_token_ids"
    ),
    WorkerCase(
        "too-many-stop-strings", gen(stop=[str(i) for i in range(17)]), IA, field="sampling.stop"
    ),
    WorkerCase(
        "ignore-eos-with-constraint",
        gen(constraint=C(regex="a"), ignore_eos=True),
        IA,
        field="sampling.ignore_eos",
    ),
    WorkerCase("constraint-empty", gen(constraint=C()), IA, field="constraint"),
    WorkerCase(
        "schema-not-json",
        gen(constraint=C(json_schema="{bad")),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.json_schema",
    ),
    WorkerCase(
        "schema-contradiction",
        gen(constraint=C(json_schema='{"type":"string","minLength":3,"maxLength":1}')),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.json_schema",
    ),
    WorkerCase(
        "schema-external-ref",
        gen(constraint=C(json_schema='{"$ref":"https://example.com/s.json"}')),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.json_schema",
    ),
    WorkerCase(
        "choice-empty",
        gen(constraint=C(choice=common_pb2.ChoiceList())),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.choice.choices",
    ),
    WorkerCase(
        "lark-does-not-compile",
        gen(constraint=C(lark="start: x")),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.lark",
    ),
    WorkerCase(
        "gbnf-does-not-compile",
        gen(constraint=C(gbnf="root ::= foo")),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.gbnf",
    ),
    WorkerCase(
        "structural-tag-bad-schema",
        gen(
            constraint=C(
                structural_tags=common_pb2.StructuralTags(
                    tags=[common_pb2.StructuralTag(begin="<f>", json_schema="{bad", end="</f>")],
                    triggers=["<f>"],
                )
            )
        ),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.structural_tags.tags[0].json_schema",
    ),
    WorkerCase(
        "regex-empty-language",
        gen(constraint=C(regex=r"[^\x00-\x{10FFFF}]")),
        IA,
        "EMPTY_LANGUAGE",
        "constraint.regex",
    ),
    WorkerCase("oversize-message", gen("x" * BIG), grpc.StatusCode.RESOURCE_EXHAUSTED),
    WorkerCase(
        "invalid-utf8-text",
        _raw_field(2, b"Hi \xff\xfe")
        + _raw_field(4, worker_pb2.SamplingParams(max_tokens=2).SerializeToString()),
        IA,
    ),
    WorkerCase("corrupt-wire-bytes", b"\xff\xff\xff", IA, reason="UNDECODABLE_REQUEST"),
]

# -- grammar service (gRPC Compile / Session) -----------------------------------------------


@dataclass(frozen=True)
class GrammarCase:
    """`compile`: one CompileRequest (or raw bytes). `session`: a stream on which request "live"
    (a JSON schema) is open first, then `messages` are sent; the expectation is about the answer
    to the last one (or the stream's status)."""

    name: str
    kind: str  # "compile" | "session"
    build: Callable[[Tokenizer], Any] = field(repr=False)
    code: grpc.StatusCode | None = None  # the call's status (None: the call succeeds)
    opened: tuple[grpc.StatusCode, str] | None = None  # Opened.error (code, reason)
    row: tuple[int, str] | None = None  # RowResult (status, error reason)
    closed_found: bool | None = None
    field: str = ""
    xfail: str = ""


LIVE_SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'


def _fp(tok: Tokenizer) -> common_pb2.TokenizerFingerprint:
    return tok.fingerprint.to_proto()


def _other_fp(tok: Tokenizer) -> common_pb2.TokenizerFingerprint:
    fp = tok.fingerprint.to_proto()
    fp.tokens_sha256 = bytes(32)
    return fp


def _open(tok: Tokenizer, rid: str = "x", **kw: Any) -> grammar_pb2.SessionRequest:
    kw.setdefault("tokenizer", _fp(tok))
    if "grammar_id" not in kw:
        kw.setdefault("constraint", C(json_schema=LIVE_SCHEMA))
    return grammar_pb2.SessionRequest(open=grammar_pb2.Open(request_id=rid, **kw))


def _step(*rows: grammar_pb2.StepRow, step: int = 1) -> grammar_pb2.SessionRequest:
    return grammar_pb2.SessionRequest(step=grammar_pb2.Step(step=step, rows=list(rows)))


def _row(rid: str, position: int, tokens: list[int] | None = None) -> grammar_pb2.StepRow:
    return grammar_pb2.StepRow(request_id=rid, position=position, new_tokens=tokens or [])


def _close(rid: str) -> grammar_pb2.SessionRequest:
    return grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id=rid))


def _compile(tok: Tokenizer, **kw: Any) -> grammar_pb2.CompileRequest:
    return grammar_pb2.CompileRequest(tokenizer=_fp(tok), **kw)


R = grammar_pb2
GRAMMAR_CASES: list[GrammarCase] = [
    GrammarCase("compile-no-constraint", "compile", lambda t: _compile(t), IA, field="constraint"),
    GrammarCase(
        "compile-bad-schema",
        "compile",
        lambda t: _compile(t, constraint=C(json_schema='{"type":5}')),
        IA,
        field="constraint.json_schema",
    ),
    GrammarCase(
        "compile-unsupported-keyword-strict-mode",
        "compile",
        lambda t: _compile(
            t,
            constraint=C(
                json_schema='{"type":"object","propertyNames":{"maxLength":3}}',
                json_options=common_pb2.JsonOptions(schema_mode=common_pb2.SCHEMA_MODE_STRICT),
            ),
        ),
        IA,
        field="constraint.json_schema",
    ),
    GrammarCase(
        "compile-schema-over-limit",
        "compile",
        lambda t: _compile(t, constraint=C(json_schema=json.dumps(five_mb_schema()))),
        IA,
        field="constraint.json_schema",
    ),
    GrammarCase(
        "compile-tokenizer-mismatch",
        "compile",
        lambda t: grammar_pb2.CompileRequest(constraint=C(regex="a"), tokenizer=_other_fp(t)),
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
    GrammarCase(
        "compile-oversize-message",
        "compile",
        lambda t: _compile(t, constraint=C(regex="a" * BIG)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
    GrammarCase(
        "compile-invalid-utf8",
        "compile",
        lambda t: _raw_field(1, _raw_field(1, b'{"type": "\xff"}')),
        IA,
    ),
    GrammarCase(
        "session-empty-message",
        "session",
        lambda t: [grammar_pb2.SessionRequest()],
        IA,
        field="kind",
    ),
    GrammarCase(
        "open-tokenizer-mismatch",
        "session",
        lambda t: [_open(t, tokenizer=_other_fp(t))],
        opened=(grpc.StatusCode.FAILED_PRECONDITION, "TOKENIZER_MISMATCH"),
    ),
    GrammarCase(
        "open-without-tokenizer",
        "session",
        lambda t: [
            grammar_pb2.SessionRequest(
                open=grammar_pb2.Open(request_id="x", constraint=C(regex="a"))
            )
        ],
        opened=(IA, ""),
    ),
    GrammarCase("open-empty-request-id", "session", lambda t: [_open(t, rid="")], opened=(IA, "")),
    GrammarCase(
        "open-duplicate-request-id",
        "session",
        lambda t: [_open(t, rid="live")],
        opened=(grpc.StatusCode.ALREADY_EXISTS, "DUPLICATE_REQUEST"),
    ),
    GrammarCase(
        "open-unknown-grammar-id",
        "session",
        lambda t: [_open(t, grammar_id="nope")],
        opened=(grpc.StatusCode.NOT_FOUND, "GRAMMAR_NOT_FOUND"),
    ),
    GrammarCase(
        "open-no-grammar",
        "session",
        lambda t: [
            grammar_pb2.SessionRequest(open=grammar_pb2.Open(request_id="x", tokenizer=_fp(t)))
        ],
        opened=(IA, ""),
    ),
    GrammarCase(
        "open-bad-schema",
        "session",
        lambda t: [_open(t, constraint=C(json_schema="[1"))],
        opened=(IA, "INVALID_CONSTRAINT"),
    ),
    GrammarCase(
        "open-replay-token-out-of-range",
        "session",
        lambda t: [_open(t, replay_tokens=[VOCAB + 7])],
        opened=(IA, "TOKEN_OUT_OF_RANGE"),
    ),
    GrammarCase(
        "open-replay-rejected",
        "session",
        lambda t: [_open(t, replay_tokens=t.encode("[1]"))],
        opened=(IA, "REPLAY_REJECTED"),
    ),
    GrammarCase(
        "step-unknown-request",
        "session",
        lambda t: [_step(_row("ghost", 0))],
        row=(R.ROW_STATUS_UNKNOWN_REQUEST, "UNKNOWN_REQUEST"),
    ),
    GrammarCase(
        "step-closed-request",
        "session",
        lambda t: [_close("live"), _step(_row("live", 0))],
        row=(R.ROW_STATUS_UNKNOWN_REQUEST, "UNKNOWN_REQUEST"),
    ),
    GrammarCase(
        "close-twice", "session", lambda t: [_close("live"), _close("live")], closed_found=False
    ),
    GrammarCase("close-unknown", "session", lambda t: [_close("ghost")], closed_found=False),
    GrammarCase(
        "step-token-out-of-range",
        "session",
        lambda t: [_step(_row("live", 1, [VOCAB]))],
        row=(R.ROW_STATUS_ERROR, "TOKEN_OUT_OF_RANGE"),
    ),
    GrammarCase(
        "step-negative-token",
        "session",
        lambda t: [_step(_row("live", 2, [5, -1]))],
        row=(R.ROW_STATUS_ERROR, "TOKEN_OUT_OF_RANGE"),
    ),
    GrammarCase(
        "step-token-rejected",
        "session",
        lambda t: [_step(_row("live", 1, t.encode("]")))],
        row=(R.ROW_STATUS_ERROR, "TOKEN_REJECTED"),
    ),
    GrammarCase(
        "step-wrong-position",
        "session",
        lambda t: [_step(_row("live", 7, t.encode("{")))],
        row=(R.ROW_STATUS_DESYNC, ""),
    ),
    GrammarCase(
        "step-duplicate-row",
        "session",
        lambda t: [_step(_row("live", 0), _row("live", 0))],
        row=(R.ROW_STATUS_ERROR, "DUPLICATE_ROW"),
    ),
    GrammarCase(
        "step-dead-request-again",
        "session",
        lambda t: [_step(_row("live", 1, [VOCAB])), _step(_row("live", 1, t.encode("{")), step=2)],
        row=(R.ROW_STATUS_ERROR, "TOKEN_OUT_OF_RANGE"),
    ),
    GrammarCase(
        "session-oversize-message",
        "session",
        lambda t: [_open(t, constraint=C(regex="a" * BIG))],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
]

# -- conversations -------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionCase:
    name: str
    api: str  # "gateway" | "worker" | "grammar"
    scenario: str  # a function name in test_catalogue.SCENARIOS
    xfail: str = ""


ACTION_CASES: list[ActionCase] = [
    ActionCase("gateway-client-vanishes-mid-stream", "gateway", "sse_disconnect"),
    ActionCase("gateway-client-vanishes-before-first-token", "gateway", "sse_disconnect_early"),
    ActionCase("gateway-non-stream-client-vanishes", "gateway", "http_disconnect"),
    ActionCase("gateway-external-ref-never-fetched", "gateway", "external_ref"),
    ActionCase("worker-client-cancels-mid-stream", "worker", "grpc_cancel"),
    ActionCase("worker-duplicate-live-request-id", "worker", "duplicate_request_id"),
    ActionCase("worker-abort-unknown-request", "worker", "abort_unknown"),
    ActionCase("grammar-stream-vanishes-with-live-requests", "grammar", "session_vanish"),
]


# -- hostile inputs, gateway and worker side ----------------------------------------------------
# Lone surrogates in any field, token ids past int32, deep nesting, prompts over the byte limits,
# errors that would echo megabytes, undecodable messages on streams.

LONE = "\ud800"  # json.dumps writes it as the escape `\ud800`, as a hostile client would
ONE_MIB = 1024 * 1024


def completion(prompt: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2}


def _nested_object_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


def _surrogate(name: str, body: Any, param: str, path: str = "/v1/chat/completions") -> HttpCase:
    return HttpCase(f"lone-surrogate-{name}", body, 400, "invalid_unicode", param, path=path)


def _bad_token(name: str, token: int) -> HttpCase:
    return HttpCase(
        f"completions-token-id-{name}",
        completion([1, token]),
        400,
        param="prompt",
        message=str(token),
        path="/v1/completions",
    )


INPUT_BOUNDS_HTTP_CASES: list[HttpCase] = [
    _surrogate(
        "content", chat(messages=[{"role": "user", "content": LONE}]), "messages[0].content"
    ),
    _surrogate("model", chat(model=LONE), "model"),
    _surrogate("stop", chat(stop=["ok", LONE]), "stop[1]"),
    _surrogate("regex", chat(structured_outputs={"regex": f"a{LONE}"}), "structured_outputs.regex"),
    _surrogate(
        "tool-description", chat(tools=[_tool(description=LONE)]), "tools[0].function.description"
    ),
    _surrogate("object-key", chat(logit_bias={LONE: 1}), "logit_bias.\\ud800"),
    _surrogate(
        "schema-as-text",
        chat(structured_outputs={"json": '{"description": "\\ud800"}'}),
        "structured_outputs.json.description",
    ),
    _surrogate("completions-prompt", completion(LONE), "prompt", "/v1/completions"),
    HttpCase(  # a surrogate encoded as UTF-8 bytes: json.loads lets it through too
        "lone-surrogate-raw-utf8-bytes",
        json.dumps(chat()).encode().replace(b"Say", b"S\xed\xa0\x80y"),
        400,
        "invalid_unicode",
        "messages[0].content",
    ),
    _bad_token("past-uint32", 2**32),
    _bad_token("past-int32", 2**31),
    _bad_token("negative", -1),
    _bad_token("at-vocab-size", VOCAB),
    HttpCase(
        "tool-parameters-nested-300",
        chat(tools=[_tool(parameters=_nested_object_schema(300))], tool_choice="required"),
        400,
        "nesting_too_deep",
        "tools[0].function.parameters",
    ),
    HttpCase(
        "schema-text-nested-3000",
        chat(structured_outputs={"json": nested_schema_text(3000)}),
        400,
        "nesting_too_deep",
        "structured_outputs.json",
    ),
    HttpCase(
        "prompt-over-max-prompt-bytes",
        chat(messages=[{"role": "user", "content": "x" * (ONE_MIB + 1)}]),
        400,
        "prompt_too_large",
        "messages",
        message="--max-prompt-bytes",
    ),
    HttpCase(
        "completions-prompt-over-max-prompt-bytes",
        completion("x" * (ONE_MIB + 1)),
        400,
        "prompt_too_large",
        "prompt",
        path="/v1/completions",
    ),
]

INPUT_BOUNDS_WORKER_CASES: list[WorkerCase] = [
    WorkerCase("text-over-max-prompt-bytes", gen("x" * (ONE_MIB + 1)), IA, field="prompt"),
    WorkerCase("token-ids-100k", ids(*[1] * 100_000), IA, field="prompt"),
    WorkerCase(
        "stop-token-ids-more-than-vocab",
        gen(stop_token_ids=[1] * (VOCAB + 1)),
        IA,
        field="sampling.stop_token_ids",
    ),
    WorkerCase(
        "request-id-too-long",
        worker_pb2.GenerateRequest(
            request_id="r" * 100_000, text="Hi", sampling=worker_pb2.SamplingParams(max_tokens=2)
        ),
        IA,
        field="request_id",
    ),
    # Echoed whole, the name would overflow gRPC's metadata limit: RESOURCE_EXHAUSTED.
    WorkerCase(
        "model-name-1mb",
        worker_pb2.GenerateRequest(text="Hi", model="m" * ONE_MIB),
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        "model",
    ),
]

INPUT_BOUNDS_ACTION_CASES: list[ActionCase] = [
    ActionCase("gateway-echoes-of-huge-input-are-bounded", "gateway", "bounded_echoes"),
    ActionCase("gateway-5mb-prompt-keeps-health", "gateway", "big_prompt_through_gateway"),
    ActionCase("worker-concurrent-big-prompts-keep-health", "worker", "big_prompts_at_worker"),
    ActionCase("grammar-session-garbage-bytes", "grammar", "session_garbage"),
    ActionCase("grammar-session-invalid-utf8-close", "grammar", "session_invalid_utf8"),
    ActionCase("grammar-reflection-garbage", "grammar", "grammar_reflection_garbage"),
    ActionCase("worker-reflection-garbage", "worker", "worker_reflection_garbage"),
]

# Request ids: one namespace for call ids and the `ID/i` ids of an n > 1 call's choices; Abort
# and cancellation stop exactly the caller's own call.
REQUEST_ID_WORKER_CASES: list[WorkerCase] = [
    WorkerCase(
        "request-id-with-slash",
        worker_pb2.GenerateRequest(
            request_id="x/0", text="Hi", sampling=worker_pb2.SamplingParams(max_tokens=2)
        ),
        IA,
        field="request_id",
    ),
]

REQUEST_ID_ACTION_CASES: list[ActionCase] = [
    ActionCase("worker-abort-empty-id-stops-nothing", "worker", "abort_empty_id"),
    ActionCase("worker-call-ids-collide-across-n", "worker", "colliding_request_ids"),
    ActionCase("worker-cancel-ends-exactly-its-own-call", "worker", "cancel_ends_its_own_call"),
]


# -- fair shares: one client cannot take every slot ---------------------------------------------
# A Session stream opens past --max-requests-per-stream: each extra Open is refused on its own,
# the stream and its requests go on (the known-good session after it opens on another stream).
STREAM_SHARE = Limits().max_requests_per_stream

FAIR_SHARE_CASES: list[Any] = [
    GrammarCase(
        "open-past-the-stream-share",
        "session",
        lambda t: [_open(t, f"s{i}", constraint=C(regex="[a-z]+")) for i in range(STREAM_SHARE)],
        opened=(grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STREAM_REQUESTS"),
    ),
]


# -- compiles: inputs counted in bytes, shared compiles -----------------------------------------
# Every string of a constraint counts against --max-schema-bytes, options included; a caller that
# cancels a compile others share leaves them their answer.


COMPILE_INPUT_GRAMMAR_CASES: list[GrammarCase] = [
    GrammarCase(
        "compile-item-separator-10mb",
        "compile",
        lambda t: _compile(
            t,
            constraint=C(
                json_object=True,
                json_options=common_pb2.JsonOptions(item_separator="," * (10 * ONE_MIB)),
            ),
        ),
        IA,
        field="constraint.json_options.item_separator",
    ),
    GrammarCase(  # schema and separator under the limit each, over it together
        "open-schema-plus-key-separator-over-limit",
        "session",
        lambda t: [
            _open(
                t,
                rid="sep",
                constraint=C(
                    json_schema=json.dumps({"description": "x" * (ONE_MIB // 2)}),
                    json_options=common_pb2.JsonOptions(key_separator=":" * (ONE_MIB // 2)),
                ),
            )
        ],
        opened=(IA, "CONSTRAINT_TOO_LARGE"),
    ),
]

COMPILE_INPUT_ACTION_CASES: list[ActionCase] = [
    ActionCase("grammar-cancelled-caller-of-a-shared-compile", "grammar", "shared_compile_cancel"),
]


# -- JSON where the gateway expects JSON text, schemas that are not schemas, formats -----------
# A JSON scalar, a number JSON cannot carry, or a malformed schema keyword is a 400 naming the
# field; every format the output check enforces is produced by the grammar, so an answer under
# one never ends in a 500 after it was generated.


def _earlier_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return chat(
        messages=[
            {"role": "user", "content": "Call f."},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
    )


def _answer_validates(
    schema: dict[str, Any], *, finishes: bool = False
) -> Callable[[dict[str, Any]], None]:
    """A finished answer validates against `schema`, formats checked. `finishes`: the case has
    tokens enough to end, so `length` is a failure (else it is allowed: a cut answer)."""
    import jsonschema

    def check(body: dict[str, Any]) -> None:
        choice = body["choices"][0]
        if choice["finish_reason"] == "length" and not finishes:
            return
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        jsonschema.Draft202012Validator(schema, format_checker=checker).validate(value)

    return check


def _string_with_format(name: str, **more: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"value": {"type": "string", "format": name, **more}},
        "required": ["value"],
        "additionalProperties": False,
    }


ARGS = "messages[1].tool_calls[0].function.arguments"
# The model answers with a sentence, which no such format admits: before formats were steered
# by the grammar, a string checked only as it closed ran into its maxLength (a dead end: 500
# `constraint_unsatisfied`) or on to the token limit.
WEATHER = [{"role": "user", "content": "Describe the weather today in one sentence."}]


def _format_case(name: str, max_length: int | None = None) -> HttpCase:
    more = {} if max_length is None else {"maxLength": max_length}
    schema = _string_with_format(name, **more)
    body = {**schema_body(schema), "messages": WEATHER, "max_tokens": 48}
    label = f"max-length-{max_length}" if max_length else "on-a-free-string"
    return HttpCase(
        f"format-{name}-{label}", body, 200, check=_answer_validates(schema, finishes=True)
    )


JSON_INPUT_HTTP_CASES: list[HttpCase] = [
    HttpCase(
        "schema-text-is-a-number",
        chat(structured_outputs={"json": "5"}),
        400,
        None,
        "structured_outputs.json",
        message="must be an object or a boolean",
    ),
    HttpCase(
        "guided-json-text-is-null",
        chat(guided_json="null"),
        400,
        None,
        "guided_json",
        message="must be an object or a boolean",
    ),
    HttpCase("guided-json-text-is-true", chat(guided_json="true"), 200, check=_finished),
    HttpCase(
        "tool-call-arguments-1e999",
        _earlier_call("1e999"),
        400,
        "invalid_number",
        ARGS,
    ),
    HttpCase(
        "tool-call-arguments-null",
        _earlier_call("null"),
        400,
        None,
        ARGS,
        message="must be a JSON object",
    ),
    HttpCase(
        "tool-call-arguments-nan-inside",
        _earlier_call('{"x": NaN}'),
        400,
        "invalid_number",
        f"{ARGS}.x",
    ),
    HttpCase(
        "schema-maximum-nan",
        raw_chat_with_schema('{"type": "number", "maximum": NaN}'),
        400,
        "invalid_number",
        f"{SCHEMA_PARAM}.maximum",
    ),
    HttpCase(
        "schema-text-integer-past-a-double",
        chat(structured_outputs={"json": '{"maximum": ' + "9" * 400 + "}"}),
        400,
        "invalid_number",
        "structured_outputs.json.maximum",
    ),
    HttpCase(
        "schema-format-not-a-string",
        schema_body({"type": "string", "format": ["date"]}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
        message="not a valid JSON Schema (draft 2020-12): 'format' at #: ['date'] is not of type",
    ),
    HttpCase(
        "schema-nested-keyword-invalid",
        schema_body({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
        message="'minLength' at #/properties/a",
    ),
    HttpCase(
        "tool-parameters-not-a-schema",
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "required": "a"}},
                }
            ],
            tool_choice="required",
        ),
        400,
        "invalid_constraint",
        "tools",
        message="not a valid JSON Schema (draft 2020-12): 'required' at #",
    ),
    _format_case("uri-reference"),
    _format_case("uri-reference", 20),
    _format_case("iri", 20),
    _format_case("json-pointer", 8),
    _format_case("relative-json-pointer", 8),
    _format_case("idn-email", 10),
    HttpCase(
        "format-draft3-color",
        schema_body(
            {
                "$schema": "http://json-schema.org/draft-03/schema#",
                "type": "object",
                "properties": {"c": {"type": "string", "format": "color"}},
            }
        ),
        400,
        "unsupported_constraint",
        SCHEMA_PARAM,
        message="'format' at #/properties/c",
    ),
    HttpCase(
        "format-llguidance-lacks-in-strict-mode",
        {**schema_body(_string_with_format("uri-reference")), "schema_mode": "strict"},
        400,
        "unsupported_constraint",
        SCHEMA_PARAM,
        message="'format' at #/properties/value: llguidance has no format 'uri-reference'",
    ),
]


def all_cases() -> list[Any]:
    from tests.robustness import hostile_grammars as hostile
    from tests.robustness import hostile_schemas

    return [
        *HTTP_CASES,
        *WORKER_CASES,
        *GRAMMAR_CASES,
        *ACTION_CASES,
        *INPUT_BOUNDS_HTTP_CASES,
        *INPUT_BOUNDS_WORKER_CASES,
        *INPUT_BOUNDS_ACTION_CASES,
        *REQUEST_ID_WORKER_CASES,
        *REQUEST_ID_ACTION_CASES,
        *COMPILE_INPUT_GRAMMAR_CASES,
        *COMPILE_INPUT_ACTION_CASES,
        *JSON_INPUT_HTTP_CASES,
        *hostile.HTTP_CASES,
        *hostile.WORKER_CASES,
        *hostile.GRAMMAR_CASES,
        *hostile.ACTION_CASES,
        *FAIR_SHARE_CASES,
        *hostile_schemas.HTTP_CASES,
        *hostile_schemas.WORKER_CASES,
        *hostile_schemas.GRAMMAR_CASES,
        *hostile_schemas.ACTION_CASES,
    ]
