"""The gateway app end to end with the `openai` client, against an in-process fake worker."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, worker_pb2
from tests.support.processes import free_port
from tests.unit.gateway.fake_worker import MODEL, FakeWorkerServer, Reply

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


@pytest.fixture(autouse=True)
def _reset(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply()


def gateway(**kw: Any) -> TestClient:
    return TestClient(create_app(GatewayConfig(**kw)), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def http(fake: FakeWorkerServer) -> Iterator[TestClient]:
    with gateway(workers=[fake.address], health_interval_s=0.5) as tc:
        yield tc


def sdk(tc: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0
    )


@pytest.fixture
def client(http: TestClient) -> openai.OpenAI:
    return sdk(http)


def last(fake: FakeWorkerServer) -> worker_pb2.GenerateRequest:
    return fake.worker.requests[-1]


def test_models_health_metrics(client: openai.OpenAI, http: TestClient) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["workers"][0]["healthy"] and h["workers"][0]["model"] == MODEL
    assert http.get("/ready").status_code == 200
    m = http.get("/metrics")
    assert m.status_code == 200 and "maskwire_gateway_requests_total" in m.text


def test_chat_request_is_translated(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        temperature=0.5,
        top_p=0.9,
        seed=-1,
        stop="END",
        max_completion_tokens=7,
        user="ignored",
        extra_body={"top_k": 5},
    )
    assert r.choices[0].message.content == "Hello world"
    assert r.choices[0].finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, 2, 9)
    req = last(fake)
    assert req.request_id == r.id and req.model == MODEL
    assert req.text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    s = req.sampling
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert (s.top_k, s.seed, list(s.stop), s.max_tokens) == (5, 2**64 - 1, ["END"], 7)
    assert not req.HasField("constraint")
    assert not req.disable_speculation


@pytest.mark.parametrize("path", ["chat", "completions"])
def test_speculation_opt_out_reaches_the_worker(
    client: openai.OpenAI, fake: FakeWorkerServer, path: str
) -> None:
    """extra_body={"speculative": false} opts one request out of speculative decoding."""
    if path == "chat":
        client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"speculative": False}
        )
    else:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"speculative": False})
    assert last(fake).disable_speculation


def test_defaults_and_finish_length(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(finish=worker_pb2.FINISH_REASON_LENGTH)
    r = client.chat.completions.create(model=MODEL, messages=USER)
    assert r.choices[0].finish_reason == "length"
    s = last(fake).sampling
    assert s.temperature == 1.0 and s.max_tokens == 0 and not s.HasField("seed")


def test_response_format_reaches_the_worker(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=['{"a": ', "1}"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
    )
    assert json.loads(r.choices[0].message.content or "") == {"a": 1}
    c = last(fake).constraint
    assert json.loads(c.json_schema) == schema and c.json_options.additional_properties == 2


def test_stream_chunks_and_usage(http: TestClient) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello world"
    )
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 9
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def _stream_calls(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict[str, str]], str]:
    content, calls, finish = "", {}, ""
    for ch in client.chat.completions.create(model=MODEL, messages=USER, stream=True, **kw):
        ch_choice = ch.choices[0]
        content += ch_choice.delta.content or ""
        for tc in ch_choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not entry["id"], "id only in the first delta of a call"
                entry["id"] = tc.id
            assert tc.function is not None
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = ch_choice.finish_reason or finish
    return content, calls, finish


HERMES = [
    "Sure. <tool_",
    'call>{"name": "get_weather", "arguments": {"ci',
    'ty": "Paris"}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}',
    "</tool_call>",
]


def test_auto_mode_parses_hermes_calls(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=HERMES)
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Sure. "
    assert msg.tool_calls is not None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    req = last(fake)
    assert req.constraint.WhichOneof("kind") == "structural_tags"
    assert "</tool_call>" not in req.sampling.stop
    assert "<tools>" in req.text

    content, calls, finish = _stream_calls(client, tools=[WEATHER])
    assert content == "Sure. " and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == got
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_without_parallel_stops_after_first_call(
    client: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    fake.worker.reply = lambda _: Reply(
        chunks=['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'],
        finish=worker_pb2.FINISH_REASON_STOP_STRING,
    )
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], parallel_tool_calls=False
    )
    assert list(last(fake).sampling.stop) == ["</tool_call>"]
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls is not None
    assert len(r.choices[0].message.tool_calls) == 1


def test_required_mode(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(
        chunks=['[{"name": "get_weather", "argu', 'ments": {"city": "Oslo"}}]']
    )
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required"
    )
    calls = r.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert r.choices[0].message.content is None
    schema = json.loads(last(fake).constraint.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1
    _, streamed, finish = _stream_calls(client, tools=[WEATHER], tool_choice="required")
    assert finish == "tool_calls"
    assert json.loads(streamed[0]["arguments"]) == {"city": "Oslo"}


def test_named_mode(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=['{"city": ', '"Lima"}'])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice=choice
    )
    calls = r.choices[0].message.tool_calls
    assert calls is not None and json.loads(calls[0].function.arguments) == {"city": "Lima"}
    assert json.loads(last(fake).constraint.json_schema) == WEATHER["function"]["parameters"]
    _, streamed, _ = _stream_calls(client, tools=[WEATHER], tool_choice=choice)
    assert streamed[0]["name"] == "get_weather"
    assert json.loads(streamed[0]["arguments"]) == {"city": "Lima"}


def test_none_mode_is_plain_text(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["<tool_call>x</tool_call>"])
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.content == "<tool_call>x</tool_call>"
    assert r.choices[0].message.tool_calls is None
    assert not last(fake).HasField("constraint") and "<tools>" not in last(fake).text


def test_completions(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    r = client.completions.create(model=MODEL, prompt="Say", echo=True)
    assert r.choices[0].text == "SayHello world" and r.object == "text_completion"
    assert last(fake).text == "Say" and last(fake).sampling.max_tokens == 16
    client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3)
    assert list(last(fake).token_ids.ids) == [1, 2, 3]
    client.completions.create(
        model=MODEL, prompt="x", extra_body={"structured_outputs": {"choice": ["a"]}}
    )
    assert list(last(fake).constraint.choice.choices) == ["a"]
    text = ""
    usage = None
    for ch in client.completions.create(
        model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True}
    ):
        text += "".join(c.text for c in ch.choices)
        usage = ch.usage or usage
    assert text == "Hello world" and usage is not None and usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("code", "exc", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, openai.BadRequestError, 400),
        (grpc.StatusCode.NOT_FOUND, openai.NotFoundError, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError, 429),
        (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, openai.InternalServerError, 504),
    ],
)
def test_worker_errors_map_to_http(
    client: openai.OpenAI,
    fake: FakeWorkerServer,
    code: grpc.StatusCode,
    exc: type[openai.APIStatusError],
    status: int,
) -> None:
    err = RpcError(code, "nope", [("constraint.json_schema", "unknown keyword `foo`")])
    fake.worker.reply = lambda _: Reply(error=err)
    with pytest.raises(exc) as e:
        client.chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_object"}
        )
    assert e.value.status_code == status
    body = e.value.body
    assert isinstance(body, dict)
    assert "unknown keyword `foo`" in body["message"]
    if status == 400:
        assert body["param"] == "response_format"


def test_streamed_request_errors_before_output_are_http_errors(
    client: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    err = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad schema", [("constraint", "why")])
    fake.worker.reply = lambda _: Reply(error=err)
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(model=MODEL, messages=USER, stream=True):
            pass


def test_generation_failure_mid_stream(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(
        chunks=["a", "b"], finish=worker_pb2.FINISH_REASON_ERROR, error_text="grammar lost"
    )
    with pytest.raises(openai.APIError, match="grammar lost"):
        for _ in client.chat.completions.create(model=MODEL, messages=USER, stream=True):
            pass
    with pytest.raises(openai.InternalServerError, match="grammar lost"):
        client.chat.completions.create(model=MODEL, messages=USER)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 9}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_unsupported_or_contradictory_is_400(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, **kw)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert isinstance(e.value.body, dict)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_malformed_bodies_are_422_in_openai_shape(http: TestClient) -> None:
    for body in (
        b"{not json",
        json.dumps({"model": MODEL}).encode(),
        json.dumps({"model": MODEL, "messages": USER, "temperature": 3}).encode(),
        json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(),
    ):
        r = http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_body_limit_is_413(fake: FakeWorkerServer) -> None:
    with gateway(workers=[fake.address], max_body_bytes=200) as tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": USER * 20})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_no_worker_is_503() -> None:
    with gateway(workers=[f"127.0.0.1:{free_port()}"]) as tc:
        with pytest.raises(openai.InternalServerError) as e:
            sdk(tc).chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 503
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "no_worker"
        assert tc.get("/health").json()["status"] == "degraded"
        assert tc.get("/ready").status_code == 503


def test_deadline_is_504(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["a", "b", "c"], delay_s=0.5)
    with gateway(workers=[fake.address], request_timeout_s=0.3) as tc:
        with pytest.raises(openai.InternalServerError) as e:
            sdk(tc).chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 504


def test_concurrency_limit_is_429(fake: FakeWorkerServer) -> None:
    gate = threading.Event()

    def slow(_: worker_pb2.GenerateRequest) -> Reply:
        gate.wait(10)
        return Reply()

    fake.worker.reply = slow
    with gateway(workers=[fake.address], max_concurrency=1) as tc:
        first = threading.Thread(
            target=lambda: sdk(tc).chat.completions.create(model=MODEL, messages=USER)
        )
        first.start()
        try:
            deadline = time.monotonic() + 10
            while len(fake.worker.requests) == 0 or tc.app.state.ctx.limiter.active == 0:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError) as e:
                sdk(tc).chat.completions.create(model=MODEL, messages=USER)
            assert e.value.status_code == 429
        finally:
            gate.set()
            first.join()
        assert sdk(tc).chat.completions.create(model=MODEL, messages=USER).choices


def test_load_balancing_and_failover(fake: FakeWorkerServer) -> None:
    with FakeWorkerServer() as other, gateway(workers=[f"{fake.address},{other.address}"]) as tc:
        c = sdk(tc)
        before = len(fake.worker.requests)
        for _ in range(4):
            c.chat.completions.create(model=MODEL, messages=USER)
        assert len(fake.worker.requests) - before == 2 and len(other.worker.requests) == 2
        # A worker that answers UNAVAILABLE before any output: the request moves on.
        other.worker.reply = lambda _: Reply(
            error=RpcError(grpc.StatusCode.UNAVAILABLE, "draining")
        )
        for _ in range(3):
            r = c.chat.completions.create(model=MODEL, messages=USER)
            assert r.choices[0].message.content == "Hello world"
        # The worker that refused is marked down; the one that answered stays up.
        health = {h["address"]: h["healthy"] for h in tc.get("/health").json()["workers"]}
        assert health == {fake.address: True, other.address: False}


def test_constraint_that_crashed_the_grammar_tier_is_not_retried(fake: FakeWorkerServer) -> None:
    crashed = RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "constraint crashed the grammar service: 2 replicas died while compiling it",
        [("constraint", "crashed the grammar service")],
        reason="CONSTRAINT_CRASHED",
    )
    tier_down = RpcError(
        grpc.StatusCode.UNAVAILABLE,
        "no grammar service replica is reachable",
        reason="GRAMMAR_SERVICE_UNAVAILABLE",
    )
    with (
        FakeWorkerServer() as a,
        FakeWorkerServer() as b,
        gateway(workers=[f"{a.address},{b.address}"]) as tc,
    ):
        c = sdk(tc)
        for fw in (a, b):
            fw.worker.reply = lambda _: Reply(error=crashed)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=MODEL, messages=USER)
        assert "constraint crashed the grammar service" in str(info.value)
        assert len(a.worker.requests) + len(b.worker.requests) == 1  # one worker, once

        # The grammar tier being down moves the request on, but marks no worker down.
        for fw in (a, b):
            fw.worker.reply = lambda _: Reply(error=tier_down)
        with pytest.raises(openai.APIStatusError) as down:
            c.chat.completions.create(model=MODEL, messages=USER)
        assert down.value.status_code == 503
        assert [h["healthy"] for h in tc.get("/health").json()["workers"]] == [True, True]


def test_client_disconnect_cancels_the_worker_call(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["x"] * 200, delay_s=0.05)
    port = free_port()
    app = create_app(GatewayConfig(workers=[fake.address]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        body = {"model": MODEL, "messages": USER, "stream": True}
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as h,
            h.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            first = json.loads(next(ln for ln in r.iter_lines() if ln)[6:])
        deadline = time.monotonic() + 10
        while first["id"] not in fake.worker.cancelled:
            assert time.monotonic() < deadline, "the worker call was not cancelled"
            time.sleep(0.05)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "maskwire_gateway_client_disconnects_total 1.0" in metrics
        assert app.state.ctx.limiter.active == 0  # the admission slot came back
    finally:
        server.should_exit = True
        thread.join(10)


def test_openapi_document(http: TestClient) -> None:
    from openapi_spec_validator import validate

    doc = http.get("/openapi.json").json()
    validate(doc)
    paths = doc["paths"]
    for p in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert p in paths
    chat = paths["/v1/chat/completions"]["post"]
    assert {"400", "404", "422", "429", "503", "504"} <= set(chat["responses"])
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in (
        "messages",
        "tools",
        "tool_choice",
        "response_format",
        "structured_outputs",
        "stream_options",
    ):
        assert field in props


REPORT = common_pb2.SchemaReport(
    mode=common_pb2.SCHEMA_MODE_COMPLETE,
    grammar_keywords=["properties", "type"],
    validated=True,
    keywords=[
        common_pb2.KeywordEnforcement(
            keyword="uniqueItems", location="#/properties/t", enforcement=3
        ),
        common_pb2.KeywordEnforcement(keyword="oneOf", location="#", enforcement=2),
        common_pb2.KeywordEnforcement(keyword="format", location="#/x", enforcement=4),
        common_pb2.KeywordEnforcement(keyword="bad key\r\n", location="#", enforcement=3),
    ],
)
SCHEMA_HEADER = "mode=complete; validated; rewritten=oneOf; runtime=uniqueItems; annotation=format"


def test_schema_enforcement_header_and_mode(http: TestClient, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["{}"], schema_report=REPORT)
    body = {
        "model": MODEL,
        "messages": USER,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        "schema_mode": "strict",
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-maskwire-schema-enforcement"] == SCHEMA_HEADER
    assert last(fake).constraint.json_options.schema_mode == common_pb2.SCHEMA_MODE_STRICT
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        assert s.headers["x-maskwire-schema-enforcement"] == SCHEMA_HEADER
        s.read()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert "x-maskwire-schema-enforcement" in r.headers  # the fake sends a report regardless
    fake.worker.reply = lambda _: Reply()
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert "x-maskwire-schema-enforcement" not in r.headers


def test_unsatisfied_constraint_is_a_named_error(
    client: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    fake.worker.reply = lambda _: Reply(
        chunks=["[1, "],
        finish=worker_pb2.FINISH_REASON_ERROR,
        error_text="constraint failed: constraint could not be satisfied: no token keeps the "
        "output valid against the schema",
    )
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=USER)
    assert info.value.code == "constraint_unsatisfied"
    assert "constraint could not be satisfied" in info.value.message
