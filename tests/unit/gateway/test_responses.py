"""The Responses API against the fake worker, with the `openai` SDK: the translation to a chat
request, output items and usage, the stream's events (also through the SDK's own accumulator),
reasoning items, function calls, and refusals that name the Responses field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from maskwire.rpc import RpcError
from maskwire.v1 import worker_pb2
from tests.unit.gateway.fake_worker import CHATML, MODEL, FakeWorkerServer, Reply

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


@pytest.fixture
def client(fake: FakeWorkerServer) -> Iterator[openai.OpenAI]:
    fake.worker.chat_template = CHATML
    fake.worker.reply = lambda _: Reply()
    with TestClient(
        create_app(GatewayConfig(workers=[fake.address])), raise_server_exceptions=False
    ) as tc:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0
        )


def sent(fake: FakeWorkerServer) -> worker_pb2.GenerateRequest:
    return fake.worker.requests[-1]


def test_string_input_and_instructions(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    r = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=20, temperature=0
    )
    assert r.status == "completed" and r.output_text == "Hello world"
    assert r.id.startswith("resp") and r.model == MODEL
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (7, 2, 9)
    req = sent(fake)
    assert req.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert req.sampling.max_tokens == 20 and req.sampling.temperature == 0
    assert not req.HasField("constraint")


def test_message_items_and_length_is_incomplete(
    client: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["a", "b"], finish=worker_pb2.FINISH_REASON_LENGTH)
    r = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Sys."},
            {"role": "user", "content": [{"type": "input_text", "text": "One"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Two", "annotations": []}],
            },
            {"role": "user", "content": "Three"},
        ],
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert "<|im_start|>assistant\nTwo<|im_end|>\n<|im_start|>user\nThree" in sent(fake).text


def test_json_schema_format_and_parse(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    class City(pydantic.BaseModel):
        name: str
        population: int

    fake.worker.reply = lambda _: Reply(chunks=['{"name": "Oslo",', ' "population": 700000}'])
    r = client.responses.parse(model=MODEL, input="A city?", text_format=City)
    assert r.output_parsed == City(name="Oslo", population=700000)
    schema = json.loads(sent(fake).constraint.json_schema)
    assert schema["required"] == ["name", "population"]
    assert sent(fake).constraint.json_options.additional_properties  # strict

    client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}})
    assert sent(fake).constraint.json_object


def test_function_calls_and_their_outputs(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(
        chunks=['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]']
    )
    r = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required"
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc")
    assert json.loads(sent(fake).constraint.json_schema)["items"]["additionalProperties"] is False

    # The call and its result go back as input items: a tool conversation in the prompt.
    fake.worker.reply = lambda _: Reply(chunks=["Sunny."])
    r2 = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in r.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[WEATHER],
    )
    assert r2.output_text == "Sunny."
    prompt = sent(fake).text
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    )
    assert "<tool_response>\nsunny\n</tool_response>" in prompt

    fake.worker.reply = lambda _: Reply(chunks=['{"city": "Rome"}'])
    named = client.responses.create(
        model=MODEL,
        input="x",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert json.loads(named.output[0].arguments) == {"city": "Rome"}  # type: ignore[union-attr]


def _events(client: openai.OpenAI, **kw: Any) -> list[Any]:
    return list(client.responses.create(model=MODEL, input="Hi", stream=True, **kw))


def test_stream_events(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["Hel", "lo"])
    events = _events(client)
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    done = events[-1].response
    assert done.output_text == "Hello" and done.usage.output_tokens == 2
    assert done.output[0].id == events[2].item.id


def test_stream_helper_accumulates_calls(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    fake.worker.reply = lambda _: Reply(chunks=["Let me check. ", *call])
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 5  # streamed incrementally
    assert "response.function_call_arguments.done" in kinds
    msg, fc = final.output
    assert msg.type == "message" and final.output_text == "Let me check. "
    assert fc.type == "function_call" and json.loads(fc.arguments) == {"city": "Oslo"}


def test_reasoning_item(fake: FakeWorkerServer) -> None:
    fake.worker.chat_template = (TEMPLATES / "chatml_think.jinja").read_text()
    fake.worker.reply = lambda _: Reply(chunks=["<think>", "Hmm.", "</think>", "Yes"])
    with TestClient(create_app(GatewayConfig(workers=[fake.address]))) as tc:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc)
        r = c.responses.create(model=MODEL, input="?", text={"format": {"type": "json_object"}})
        events = list(c.responses.create(model=MODEL, input="?", stream=True))
    rsn, msg = r.output
    assert msg.type == "message"
    assert rsn.type == "reasoning" and rsn.content is not None and rsn.content[0].text == "Hmm."
    assert r.output_text == "Yes"
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 3
    assert sent(fake).reasoning_end_marker == "</think>"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Hmm."
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == [
        "reasoning",
        "message",
    ]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ],
)
def test_refusals_name_the_responses_field(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    kw.setdefault("input", "Hi")
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model=MODEL, **kw)
    assert e.value.status_code in (400, 422)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == param, body


def test_worker_schema_error_names_text_format_schema(
    client: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    import grpc

    fake.worker.reply = lambda _: Reply(
        error=RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid constraint.json_schema: bad",
            [("constraint.json_schema", "bad")],
            reason="INVALID_CONSTRAINT",
        )
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input="x",
            text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        )
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "text.format.schema"


def test_chat_param_names_are_translated_in_template_errors(
    client: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "x"},
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "f",
                    "arguments": "[" * 100 + "]" * 100,
                },
            ],
        )
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "input[1].arguments", body
