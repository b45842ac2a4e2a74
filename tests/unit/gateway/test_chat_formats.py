"""Chat completions with thinking models and the non-Hermes tool formats, against the fake
worker: what reaches the worker (prompt, marker, constraint) and how its text comes back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from tests.unit.gateway.fake_worker import CHATML, MODEL, FakeWorkerServer, Reply

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
THINKING = ["<think>", "Let me", " see.</think>", "\n\nIt is", " sunny."]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


def client(fake: FakeWorkerServer, template: str, **config: Any) -> Iterator[openai.OpenAI]:
    fake.worker.chat_template = template
    app = create_app(GatewayConfig(workers=[fake.address], **config))
    with TestClient(app, raise_server_exceptions=False) as tc:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0
        )


@pytest.fixture
def thinking(fake: FakeWorkerServer) -> Iterator[openai.OpenAI]:
    yield from client(fake, (TEMPLATES / "chatml_think.jinja").read_text())


def test_reasoning_content_apart_from_content(
    thinking: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    fake.worker.reply = lambda _: Reply(chunks=THINKING)
    r = thinking.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format={"type": "json_object"},
    )
    msg = r.choices[0].message
    assert msg.content == "It is sunny."
    assert msg.model_extra is not None and msg.model_extra["reasoning_content"] == "Let me see."
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 3  # up to `</think>`
    sent = fake.worker.requests[-1]
    assert sent.reasoning_end_marker == "</think>"  # the grammar waits for it
    assert sent.constraint.json_object


def test_reasoning_streams_separately(thinking: openai.OpenAI, fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=THINKING)
    reasoning, content = [], []
    for chunk in thinking.chat.completions.create(model=MODEL, messages=USER, stream=True):
        delta = chunk.choices[0].delta
        if (delta.model_extra or {}).get("reasoning_content"):
            assert not delta.content
            reasoning.append(delta.model_extra["reasoning_content"])  # type: ignore[index]
        elif delta.content:
            content.append(delta.content)
    assert "".join(reasoning) == "Let me see."
    assert content == ["It is", " sunny."]


def test_thinking_switched_off_is_all_answer(
    thinking: openai.OpenAI, fake: FakeWorkerServer
) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["Sunny."])
    r = thinking.chat.completions.create(
        model=MODEL, messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.choices[0].message.content == "Sunny."
    assert (r.choices[0].message.model_extra or {}).get("reasoning_content") is None
    sent = fake.worker.requests[-1]
    assert sent.text.endswith("<think>\n\n</think>\n\n") and sent.reasoning_end_marker == ""


def test_mistral_template_required_calls(fake: FakeWorkerServer) -> None:
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    fake.worker.reply = lambda _: Reply(
        chunks=["[", json.dumps(call)[:20], json.dumps(call)[20:], "]"]
    )
    for c in client(fake, (TEMPLATES / "mistral_v3_tekken.jinja").read_text()):
        r = c.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required"
        )
    sent = fake.worker.requests[-1]
    assert sent.text.startswith("[AVAILABLE_TOOLS]")  # the fake's BOS text is empty
    assert sent.text.endswith("[/INST][TOOL_CALLS]")
    assert json.loads(sent.constraint.json_schema)["type"] == "array"
    (tc,) = r.choices[0].message.tool_calls or []
    assert (tc.function.name, json.loads(tc.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert len(tc.id) == 9 and tc.id.isalnum()
    assert r.choices[0].finish_reason == "tool_calls"


def test_tool_call_parser_flag_overrides_the_template(fake: FakeWorkerServer) -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    fake.worker.reply = lambda _: Reply(chunks=[text[:9], text[9:]])
    for c in client(fake, CHATML, tool_call_parser="llama3_json"):
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    sent = fake.worker.requests[-1]
    assert 'Respond in the format {"name": function name, "parameters"' in sent.text
    assert sent.constraint.lark.startswith("start: TEXT | calls")
    (tc,) = r.choices[0].message.tool_calls or []
    assert json.loads(tc.function.arguments) == {"city": "Oslo"}
