"""Fuzzing the three APIs for the next hostile input (slow stage).

Hypothesis generates nested JSON schemas, Lark grammars, regexes and chat bodies with odd Unicode
and odd numbers. Whatever it sends: the answer is never a 5xx nor an `INTERNAL` / `UNKNOWN` /
`UNAVAILABLE` status, and afterwards every service is the same process and answers its health
check within a second. Classes of input that once broke a service live in the catalogue; this
suite looks for new ones.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from maskwire.rpc import RpcError, channel_options
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.robustness.stack import MODEL, Stack

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples every run: a failure reproduces
)
# Statuses a service may answer a bad input with; never INTERNAL, UNKNOWN or UNAVAILABLE.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
}

# -- strategies ------------------------------------------------------------------------------

ODD_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from("\x00\u202e\ufeff"),
    max_size=40,
)
ODD_NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -0.0, 1e308, -1e308, 5e-324, 2**31, 2**32, 2**53 + 1]),
)
TYPES = st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "null"])


def _schemas(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keyword = st.one_of(
        st.tuples(st.just("type"), TYPES | st.lists(TYPES, min_size=1, max_size=3)),
        st.tuples(st.just("properties"), st.dictionaries(ODD_TEXT, children, max_size=4)),
        st.tuples(st.just("items"), children),
        st.tuples(st.just("anyOf"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("allOf"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("oneOf"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("enum"), st.lists(ODD_TEXT | ODD_NUMBER, min_size=1, max_size=4)),
        st.tuples(st.just("const"), ODD_TEXT | ODD_NUMBER),
        st.tuples(st.sampled_from(["minimum", "maximum", "multipleOf"]), ODD_NUMBER),
        st.tuples(st.sampled_from(["minLength", "maxLength", "minItems", "maxItems"]), ODD_NUMBER),
        st.tuples(st.just("pattern"), st.sampled_from(["^a+$", "(", "[a-z]{2,}", "\\p{L}+", ""])),
        st.tuples(st.just("format"), st.sampled_from(["date", "email", "uuid", "nonsense"])),
        st.tuples(st.just("required"), st.lists(ODD_TEXT, max_size=3)),
        st.tuples(st.just("additionalProperties"), st.booleans() | children),
        st.tuples(st.just("$ref"), st.sampled_from(["#/$defs/a", "#", "#/nope", "http://x/y"])),
    )
    return st.lists(keyword, max_size=4).map(dict)


SCHEMAS = st.recursive(
    st.booleans() | st.just({}) | TYPES.map(lambda t: {"type": t}), _schemas, max_leaves=25
).map(lambda s: {"$defs": {"a": {"type": "integer"}}, **s} if isinstance(s, dict) else s)


def _lark(rules: list[tuple[str, list[list[str]]]]) -> str:
    names = [f"r{i}" for i in range(len(rules))]
    lines = []
    for i, (_, alts) in enumerate(rules):
        body = " | ".join(" ".join(a) or '""' for a in alts)
        lines.append(f"{names[i]}: {body}")
    return "start: r0\n" + "\n".join(lines) if lines else "start: r0"


ATOM = st.one_of(
    st.sampled_from(['"a"', '"b"', "/[0-9]+/", "/[a-z]*/", '"\\u00e9"', "r0", "r1", "r2", "(r1)*"]),
    ODD_TEXT.map(json.dumps),
)
LARK = st.lists(
    st.tuples(st.just(""), st.lists(st.lists(ATOM, max_size=4), min_size=1, max_size=4)),
    min_size=1,
    max_size=6,
).map(_lark)
REGEX = st.lists(
    st.sampled_from(
        [
            "a",
            "b",
            ".",
            "[a-z]",
            "[^x]",
            "(",
            ")",
            "|",
            "*",
            "+",
            "?",
            "{2,5}",
            "{0,1000}",
            "\\d",
            "\\p{L}",
            "^",
            "$",
            "é",
            "\\",
            "(?:",
            "[",
            "]",
        ]
    ),
    max_size=16,
).map("".join)


# -- checks ----------------------------------------------------------------------------------


def assert_responsive(stack: Stack) -> None:
    for svc in (stack.grammar, stack.worker):
        assert svc.proc.poll() is None, f"{svc.command} died:\n{svc.log_text()[-3000:]}"
        t0 = time.monotonic()
        with grpc.insecure_channel(svc.address) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert time.monotonic() - t0 < 1.0, f"{svc.command} health took too long"
    assert stack.gateway.proc.poll() is None
    t0 = time.monotonic()
    assert httpx.get(f"{stack.base_url}/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0


def compile_status(stack: Stack, constraint: common_pb2.Constraint) -> grpc.StatusCode:
    with grpc.insecure_channel(stack.grammar.address, options=channel_options()) as ch:
        try:
            grammar_pb2_grpc.GrammarServiceStub(ch).Compile(
                grammar_pb2.CompileRequest(
                    constraint=constraint, tokenizer=stack.tokenizer.fingerprint.to_proto()
                ),
                timeout=60,
            )
        except grpc.RpcError as e:
            err = RpcError.from_call_error(e)  # type: ignore[arg-type]
            assert "Traceback" not in err.message
            return err.code
    return grpc.StatusCode.OK


# -- the fuzzers -----------------------------------------------------------------------------


@FUZZ
@given(schema=SCHEMAS)
def test_fuzz_json_schemas(stack: Stack, schema: Any) -> None:
    code = compile_status(stack, common_pb2.Constraint(json_schema=json.dumps(schema)))
    event(code.name)
    assert code in ALLOWED, (code, schema)
    assert_responsive(stack)


@FUZZ
@given(lark=LARK)
def test_fuzz_lark_grammars(stack: Stack, lark: str) -> None:
    code = compile_status(stack, common_pb2.Constraint(lark=lark))
    event(code.name)
    assert code in ALLOWED, (code, lark)
    assert_responsive(stack)


@FUZZ
@given(regex=REGEX)
def test_fuzz_regexes_through_the_worker(stack: Stack, regex: str) -> None:
    with grpc.insecure_channel(stack.worker.address) as ch:
        req = worker_pb2.GenerateRequest(
            text="Hi",
            sampling=worker_pb2.SamplingParams(max_tokens=3),
            constraint=common_pb2.Constraint(regex=regex),
        )
        try:
            list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
    event(code.name)
    assert code in ALLOWED, (code, regex)
    assert_responsive(stack)


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | ODD_NUMBER | ODD_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": ODD_NUMBER,
        "top_p": ODD_NUMBER,
        "max_tokens": ODD_NUMBER,
        "seed": ODD_NUMBER,
        "stop": st.lists(ODD_TEXT, max_size=4) | ODD_TEXT,
        "logit_bias": st.dictionaries(ODD_TEXT, ODD_NUMBER, max_size=3),
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["json_schema", "json_object", "text", "nope"])},
            optional={"json_schema": st.fixed_dictionaries({"name": ODD_TEXT, "schema": SCHEMAS})},
        ),
        "structured_outputs": st.dictionaries(
            st.sampled_from(["regex", "choice", "grammar", "json"]), JSON_VALUE, max_size=2
        ),
        "extra": JSON_VALUE,
    },
)
# Lone surrogates can only arrive as JSON text: `json.dumps` writes them as `\ud8xx` escapes.
SURROGATE = st.integers(min_value=0xD800, max_value=0xDFFF).map(chr)


@FUZZ
@given(fields=FIELDS, content=ODD_TEXT | SURROGATE)
def test_fuzz_chat_bodies(stack: Stack, fields: dict[str, Any], content: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    body.setdefault("max_tokens", 3)
    r = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    event(str(r.status_code))
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    assert_responsive(stack)
