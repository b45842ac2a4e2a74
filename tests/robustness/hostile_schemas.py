"""Catalogue cases for what a schema's output check runs: references it must never resolve outside
the schema as sent (a listener that counts connections, one that accepts and never answers, a local
file), and patterns on which a backtracking engine takes exponential time (`(a+)+c|a+b` on 27 `a`s
then `b`: seconds per match in Python's `re`), which the check matches in linear time while the
grammar replica's health keeps answering. Patterns RE2 cannot run are refused up front, also
where the grammar never sees them (under `not`, `if`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.rpc import RpcError, channel_options
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2_grpc
from tests.robustness.catalogue import (
    IA,
    SCHEMA_PARAM,
    ActionCase,
    GrammarCase,
    HttpCase,
    WorkerCase,
    _compile,
    chat,
    gen,
    schema_body,
)
from tests.robustness.stack import Stack
from tests.support.listeners import (
    Listener,
    external_schemas,
    file_proves_itself,
    unread,
    watched_file,
)

C = common_pb2.Constraint
HOSTILE = "(a+)+c|a+b"
RUN = "a" * 27 + "b"
CLOSED = "http://127.0.0.1:9/schema.json"  # the discard port: nothing listens (and none is made)


def _json(schema: Any) -> C:
    return C(json_schema=json.dumps(schema))


HTTP_CASES: list[HttpCase] = [
    HttpCase(
        "schema-ref-under-not",
        schema_body({"type": "integer", "not": {"$ref": CLOSED}}),
        400,
        "invalid_constraint",
        SCHEMA_PARAM,
        message="never fetched",
    ),
    HttpCase(
        "schema-lookahead-under-not",
        schema_body({"type": "string", "not": {"pattern": "(?=a)b"}}),
        400,
        "unsupported_constraint",
        SCHEMA_PARAM,
        message="lookahead is not supported",
    ),
]

WORKER_CASES: list[WorkerCase] = [
    WorkerCase(
        "schema-ref-under-if",
        gen(constraint=_json({"if": {"$ref": CLOSED}, "then": {"type": "integer"}})),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.json_schema",
    ),
    WorkerCase(
        "schema-backreference-under-if",
        gen(constraint=_json({"if": {"pattern": "(a)\\1"}, "then": {"minLength": 2}})),
        IA,
        "UNSUPPORTED_CONSTRAINT",
        "constraint.json_schema",
    ),
]

GRAMMAR_CASES: list[GrammarCase] = [
    GrammarCase(
        "compile-dynamic-ref-to-url",
        "compile",
        lambda t: _compile(t, constraint=_json({"items": {"$dynamicRef": CLOSED + "#m"}})),
        IA,
        field="constraint.json_schema",
    ),
    GrammarCase(
        "compile-lookbehind-pattern-property-under-not",
        "compile",
        lambda t: _compile(t, constraint=_json({"not": {"patternProperties": {"(?<=a)b": {}}}})),
        IA,
        field="constraint.json_schema",
    ),
]

ACTION_CASES: list[ActionCase] = [
    ActionCase("grammar-references-never-leave-the-schema", "grammar", "refs_never_resolved"),
    ActionCase("grammar-backtracking-patterns-keep-health", "grammar", "backtracking_patterns"),
]


# -- scenarios ------------------------------------------------------------------------------


def _rpc_error(call: Callable[[], Any]) -> RpcError:
    try:
        call()
    except grpc.RpcError as e:
        return RpcError.from_call_error(e)  # type: ignore[arg-type]
    raise AssertionError("the call succeeded")


def refs_never_resolved(stack: Stack) -> None:
    """References under `not`, `if`, `$dynamicRef`, `propertyNames` and `oneOf` to a counting
    listener, a silent one and a local file: refused naming the reference by the grammar
    service's Compile, the worker's Generate and the gateway, and never touched."""
    tok = stack.tokenizer
    with (
        TemporaryDirectory() as tmp,
        Listener(answer=True) as counting,
        Listener(answer=False) as silent,
    ):
        schema_file = watched_file(Path(tmp))
        with (
            grpc.insecure_channel(stack.grammar.address, options=channel_options()) as gch,
            grpc.insecure_channel(stack.worker.address, options=channel_options()) as wch,
        ):
            compile_ = grammar_pb2_grpc.GrammarServiceStub(gch).Compile
            generate = worker_pb2_grpc.WorkerStub(wch).Generate
            for url in (counting.url, silent.url, schema_file.as_uri()):
                for schema in external_schemas(url):
                    t0 = time.monotonic()
                    c = _json(schema)
                    errors = [
                        _rpc_error(lambda c=c: compile_(_compile(tok, constraint=c), timeout=60)),
                        _rpc_error(lambda c=c: list(generate(gen(constraint=c), timeout=60))),
                    ]
                    for err in errors:
                        assert err.code is IA and err.reason == "INVALID_CONSTRAINT", err.message
                        assert url in err.message and "never fetched" in err.message, err.message
                        assert err.violations[0][0] == "constraint.json_schema"
                    r = httpx.post(
                        f"{stack.base_url}/v1/chat/completions",
                        json=schema_body(schema),
                        timeout=60,
                    )
                    assert r.status_code == 400, r.text
                    err_body = r.json()["error"]
                    assert err_body["code"] == "invalid_constraint", err_body
                    assert err_body["param"] == SCHEMA_PARAM and url in err_body["message"]
                    # No answer waited for a fetch (the silent listener would hold one).
                    assert time.monotonic() - t0 < 30, schema
        assert counting.connections == 0 and silent.connections == 0
        assert unread(schema_file)
        counting.proves_itself()
        silent.proves_itself()
        file_proves_itself(schema_file)


# Health of the grammar replica while the hostile patterns are checked. It answers in a few ms
# with the linear-time check; the old backtracking check held the event loop for seconds per
# match (~8 s for 27 `a`s). The bound is 10x the 100 ms target: a loaded shared machine can delay
# the polling thread itself.
HEALTH_BOUND_S = 1.0


class _GrammarHealth:
    """Polls the grammar replica's gRPC health in a thread, recording the slowest answer."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.slowest = 0.0
        self.answers = 0
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                except grpc.RpcError as e:
                    self.bad.append(str(e.code()))
                else:
                    if resp.status != health_pb2.HealthCheckResponse.SERVING:
                        self.bad.append("not serving")
                self.slowest = max(self.slowest, time.perf_counter() - t0)
                self.answers += 1
                time.sleep(0.02)

    def __enter__(self) -> _GrammarHealth:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def __repr__(self) -> str:
        return f"grammar health: {self.answers} answers, slowest {self.slowest:.3f}s, {self.bad}"


# (schema, the output it forces): the hostile pattern as `pattern`, under `not`, as
# `propertyNames` (which the layer also uses to rewrite the object's properties).
BACKTRACKING: list[tuple[dict[str, Any], str]] = [
    ({"type": "string", "enum": [RUN], "pattern": HOSTILE}, json.dumps(RUN)),
    ({"type": "string", "enum": [RUN], "not": {"pattern": "(a+)+c"}}, json.dumps(RUN)),
    (
        {
            "type": "object",
            "properties": {RUN: {"type": "integer", "enum": [7]}},
            "required": [RUN],
            "additionalProperties": False,
            "propertyNames": {"pattern": HOSTILE},
        },
        json.dumps({RUN: 7}),
    ),
]


def _session_accepts(stack: Stack, schema: dict[str, Any], text: str) -> None:
    """Open the schema on a grammar Session and step the whole output in: accepted, OK."""
    tok = stack.tokenizer
    tokens = tok.encode(text)
    msgs = [
        grammar_pb2.SessionRequest(
            open=grammar_pb2.Open(
                request_id="hostile",
                constraint=_json(schema),
                tokenizer=tok.fingerprint.to_proto(),
            )
        ),
        grammar_pb2.SessionRequest(
            step=grammar_pb2.Step(
                step=1,
                rows=[
                    grammar_pb2.StepRow(
                        request_id="hostile", new_tokens=tokens, position=len(tokens)
                    )
                ],
            )
        ),
        grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id="hostile")),
    ]
    with grpc.insecure_channel(stack.grammar.address, options=channel_options()) as ch:
        answers = list(grammar_pb2_grpc.GrammarServiceStub(ch).Session(iter(msgs), timeout=60))
    assert not answers[0].opened.HasField("error"), answers[0]
    row = answers[1].step_result.rows[0]
    assert row.status == grammar_pb2.ROW_STATUS_OK and row.accepting, row


def backtracking_patterns(stack: Stack) -> None:
    """Each hostile schema through the gateway (the model's output is forced) and on a grammar
    Session: answered correctly within the step budget (no GRAMMAR_TOO_EXPENSIVE, no 504),
    while the grammar replica's health answers quickly throughout."""
    with _GrammarHealth(stack.grammar.address) as watch:
        for schema, text in BACKTRACKING:
            body = chat(
                max_tokens=40,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            )
            r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text[:1000]
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            assert json.loads(choice["message"]["content"]) == json.loads(text), choice
            _session_accepts(stack, schema, text)
    assert watch.answers > 0 and not watch.bad, watch
    assert watch.slowest < HEALTH_BOUND_S, watch


SCENARIOS: dict[str, Callable[[Stack], None]] = {
    f.__name__: f for f in (refs_never_resolved, backtracking_patterns)
}
