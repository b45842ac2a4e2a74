"""Hostile request bodies get 400s in OpenAI's shape that name the field:
lone surrogates anywhere, token ids past int32, deep nesting, oversized prompts, and error
messages that would echo megabytes of input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from maskwire.rpc import RpcError
from maskwire.text import MESSAGE_LIMIT
from tests.unit.gateway.fake_worker import MODEL, FakeWorkerServer, Reply

LONE = "\ud800"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


def gateway(fake: FakeWorkerServer, **kw: Any) -> TestClient:
    config = GatewayConfig(workers=[fake.address], **kw)
    return TestClient(create_app(config), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def http(fake: FakeWorkerServer) -> Iterator[TestClient]:
    with gateway(fake, max_prompt_bytes=4096) as tc:
        yield tc


@pytest.fixture(autouse=True)
def _reset(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply()


def post(tc: TestClient, body: Any, path: str = "/v1/chat/completions") -> tuple[int, Any]:
    # json.dumps writes a lone surrogate as the escape `\ud800`, as a hostile client would.
    r = tc.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def error(tc: TestClient, body: Any, path: str = "/v1/chat/completions") -> dict[str, Any]:
    status, answer = post(tc, body, path)
    assert status == 400, answer
    err: dict[str, Any] = answer["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **kw}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=[{"role": "user", "content": f"a{LONE}b"}]), "messages[0].content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
            "messages[0].content[0].text",
        ),
        (chat(model=LONE), "model"),
        (chat(stop=["ok", LONE]), "stop[1]"),
        (chat(structured_outputs={"regex": f"[{LONE}]"}), "structured_outputs.regex"),
        (chat(structured_outputs={"choice": ["a", LONE]}), "structured_outputs.choice[1]"),
        (
            chat(tools=[{**TOOL, "function": {**TOOL["function"], "description": LONE}}]),
            "tools[0].function.description",
        ),
        (chat(logit_bias={LONE: 1}), "logit_bias.\\ud800"),
        (chat(user=LONE), "user"),
        (chat(guided_json=json.dumps({"description": LONE})), "guided_json.description"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(
    http: TestClient, body: dict[str, Any], param: str
) -> None:
    err = error(http, body)
    assert err["code"] == "invalid_unicode" and err["param"] == param, err


def test_lone_surrogate_in_a_completions_prompt(http: TestClient) -> None:
    for prompt, param in ((LONE, "prompt"), (["ok", LONE], "prompt[1]")):
        err = error(http, {"model": MODEL, "prompt": prompt}, "/v1/completions")
        assert err["param"] == param


def test_lone_surrogate_in_tool_call_arguments_text(http: TestClient) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '"\\ud800"'}}
    body = chat(messages=[*USER, {"role": "assistant", "tool_calls": [call]}], tools=[TOOL])
    err = error(http, body)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("token", [2**32, 2**31, -1, 49152])
def test_token_ids_outside_the_vocabulary_are_400(
    http: TestClient, fake: FakeWorkerServer, token: int
) -> None:
    seen = len(fake.worker.requests)
    for prompt in ([1, 2, token], [[1, token]]):
        err = error(http, {"model": MODEL, "prompt": prompt}, "/v1/completions")
        assert err["param"] == "prompt" and str(token) in err["message"]
    assert len(fake.worker.requests) == seen  # never reached the worker


def test_token_prompt_longer_than_the_context_is_400_before_checking_ids(http: TestClient) -> None:
    err = error(http, {"model": MODEL, "prompt": [1] * 10_000}, "/v1/completions")
    assert err["param"] == "prompt" and "context" in err["message"]


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("depth", [150, 400])
def test_deep_tool_parameters_are_400(http: TestClient, depth: int) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(depth)}}
    for choice in ("auto", "required"):
        err = error(http, chat(tools=[tool], tool_choice=choice))
        assert err["code"] == "nesting_too_deep"
        assert err["param"] == "tools[0].function.parameters"


def test_moderate_nesting_still_works(http: TestClient, fake: FakeWorkerServer) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(20)}}
    status, answer = post(http, chat(tools=[tool], tool_choice="required"))
    assert status == 200, answer


def test_deep_json_text_is_400(http: TestClient) -> None:
    text = '{"type":"array","items":' * 2000 + "{}" + "}" * 2000
    err = error(http, chat(structured_outputs={"json": text}))
    assert err["param"] == "structured_outputs.json" and err["code"] == "nesting_too_deep"


def _call(arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


def _earlier_call(arguments: str, **kw: Any) -> dict[str, Any]:
    return chat(messages=[*USER, {"role": "assistant", "tool_calls": [_call(arguments)]}], **kw)


ARGS = "messages[1].tool_calls[0].function.arguments"
NOT_A_NUMBER = '{"type": "number", "maximum": NaN}'


@pytest.mark.parametrize(
    ("body", "path", "param", "code"),
    [
        # JSON text that is a scalar where an object (a schema, arguments) is expected
        (chat(structured_outputs={"json": "5"}), "", "structured_outputs.json", None),
        (chat(guided_json="null"), "", "guided_json", None),
        (chat(guided_json="[1]"), "", "guided_json", None),
        (_earlier_call("null"), "", ARGS, None),
        (_earlier_call("5"), "", ARGS, None),
        (_earlier_call('"text"', tools=[TOOL]), "", ARGS, None),
        (
            {"model": MODEL, "prompt": "x", "guided_json": "7"},
            "/v1/completions",
            "guided_json",
            None,
        ),
        # numbers JSON cannot carry, as text or in objects of the body
        (_earlier_call("1e999"), "", ARGS, "invalid_number"),
        (_earlier_call('{"a": NaN}', tools=[TOOL]), "", f"{ARGS}.a", "invalid_number"),
        (_earlier_call("9" * 5000), "", ARGS, "invalid_number"),
        (
            chat(structured_outputs={"json": NOT_A_NUMBER}),
            "",
            "structured_outputs.json.maximum",
            "invalid_number",
        ),
        (chat(guided_json='{"minimum": -Infinity}'), "", "guided_json.minimum", "invalid_number"),
        (
            {
                "model": MODEL,
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "1e999"}
                ],
            },
            "/v1/responses",
            "input[0].arguments",
            "invalid_number",
        ),
    ],
)
def test_json_text_of_the_wrong_kind_is_400_naming_the_field(
    http: TestClient, body: dict[str, Any], path: str, param: str, code: str | None
) -> None:
    err = error(http, body, path or "/v1/chat/completions")
    assert err["param"] == param and err["code"] == code, err


@pytest.mark.parametrize(
    ("raw", "path", "param"),
    [
        (
            '{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
            '{"type": "number", "maximum": NaN}}}}',
            "",
            "response_format.json_schema.schema.maximum",
        ),
        (
            '{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": '
            '"object", "properties": {"a": {"maximum": Infinity}}}}}]}',
            "",
            "tools[0].function.parameters.properties.a.maximum",
        ),
        (
            '{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": '
            '"object", "properties": {"a": {"minimum": -1e999}}}}]}',
            "/v1/responses",
            "tools[0].parameters.properties.a.minimum",
        ),
        (
            '{"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": '
            '{"maximum": NaN}}}}',
            "/v1/responses",
            "text.format.schema.maximum",
        ),
        (
            '{"prompt": "x", "guided_json": {"maximum": NaN}}',
            "/v1/completions",
            "guided_json.maximum",
        ),
    ],
)
def test_numbers_json_cannot_carry_in_body_schemas_are_400(
    http: TestClient, fake: FakeWorkerServer, raw: str, path: str, param: str
) -> None:
    """Python's JSON parser reads `NaN`, `Infinity` and `1e999` in a body: a schema holding one
    never reaches a worker (it would travel as text no other parser reads)."""
    seen = len(fake.worker.requests)
    head = f'{{"model": "{MODEL}", ' + (
        '"messages": [{"role": "user", "content": "hi"}], ' if not path else ""
    )
    r = http.post(
        path or "/v1/chat/completions",
        content=head + raw[1:],
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_number", err
    assert len(fake.worker.requests) == seen


def test_boolean_schema_text_and_object_arguments_pass(http: TestClient) -> None:
    for body in (chat(guided_json="true"), _earlier_call('{"a": 1e300}', tools=[TOOL])):
        status, answer = post(http, body)
        assert status == 200, answer


def test_prompt_over_max_prompt_bytes_is_400(http: TestClient, fake: FakeWorkerServer) -> None:
    seen = len(fake.worker.requests)
    err = error(http, chat(messages=[{"role": "user", "content": "é" * 3000}]))
    assert err["code"] == "prompt_too_large" and err["param"] == "messages"
    assert "--max-prompt-bytes" in err["message"]
    err = error(http, {"model": MODEL, "prompt": "x" * 5000}, "/v1/completions")
    assert err["code"] == "prompt_too_large" and err["param"] == "prompt"
    assert len(fake.worker.requests) == seen


def test_echoed_input_is_bounded(http: TestClient) -> None:
    name = "m" * 1_000_000
    status, answer = post(http, chat(model=name))
    assert status == 404 and len(answer["error"]["message"]) < 1000, len(str(answer))
    # pydantic's locations hold the client's keys; its messages can quote values
    status, answer = post(http, chat(logit_bias={"k" * 1_000_000: "not a number"}))
    assert status == 422 and len(json.dumps(answer)) < 2 * MESSAGE_LIMIT
    status, answer = post(http, chat(response_format={"type": "t" * 1_000_000}))
    assert status == 422 and len(json.dumps(answer)) < 2 * MESSAGE_LIMIT
    many = chat(messages=[{"role": "robot", "content": "x"}] * 1000)
    status, answer = post(http, many)
    assert status == 422 and "more errors" in answer["error"]["message"]


def test_a_long_worker_error_keeps_its_status(http: TestClient, fake: FakeWorkerServer) -> None:
    """A 200 KB message and violation (an invalid regex quoted whole) is still a 400."""
    huge = "(" * 200_000
    err = RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid regex {huge}",
        [("constraint.regex", f"unclosed group in {huge}")],
        reason="INVALID_CONSTRAINT",
    )
    fake.worker.reply = lambda _: Reply(error=err)
    status, answer = post(http, chat(structured_outputs={"regex": "a"}))
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_constraint"
    assert answer["error"]["param"] == "structured_outputs.regex"
    assert len(answer["error"]["message"]) <= MESSAGE_LIMIT


def test_unencodable_text_or_recursion_anywhere_is_400(fake: FakeWorkerServer) -> None:
    """The safety nets: causes the input checks do not foresee are still the client's."""
    app = create_app(GatewayConfig(workers=[fake.address]))

    @app.get("/v1/boom/{kind}")
    async def boom(kind: str) -> None:
        if kind == "unicode":
            LONE.encode()
        raise RecursionError("maximum recursion depth exceeded")

    with TestClient(app, raise_server_exceptions=False) as tc:
        for kind, code in (("unicode", "invalid_unicode"), ("deep", "nesting_too_deep")):
            r = tc.get(f"/v1/boom/{kind}")
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
