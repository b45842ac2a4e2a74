"""Reasoning and the three tool-call formats on live stacks (grammar service + worker + gateway),
with the official `openai` SDK. Each family is a tiny scripted checkpoint (`tests.support.
scripted_model`) with the family's real chat template and special tokens: the model writes its
family's marker on cue (`<think>`, `{"`, `[TOOL_CALLS]`), so whatever follows is the grammar's
doing and the answer shows the constraint applied exactly where the format says."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.processes import full_stack, openai_client
from tests.support.scripted_model import scripted_checkpoint, smollm_with_specials

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "string", "enum": ["Paris", "Oslo"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
}
ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "a", "strict": True, "schema": ANSWER},
}
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]


def _client(
    path: Path, worker_args: tuple[str, ...] = (), **checkpoint: Any
) -> Iterator[openai.OpenAI]:
    with full_stack(str(scripted_checkpoint(path, **checkpoint)), worker_args=worker_args) as g:
        yield openai_client(g)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _client(
        tmp_path_factory.mktemp("think") / "think",
        chat_template=(TEMPLATES / "chatml_think.jinja").read_text(),
        tokenizer_json=smollm_with_specials(["<think>", "</think>"]),
        eos_token="<|im_end|>",
        prompt_end="<|im_start|>assistant\n",
        text="<think>Let me think.</think>Hello there",
    )


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _client(
        tmp_path_factory.mktemp("llama") / "llama3",
        # A message per step: the streamed call's arguments arrive as the scripted model makes
        # them (held 20 ms, the fast script's whole call would come in one message).
        worker_args=("--stream-interval-ms", "0"),
        chat_template=(TEMPLATES / "llama3_json.jinja").read_text(),
        tokenizer_json=smollm_with_specials(LLAMA_SPECIALS),
        eos_token="<|eot_id|>",
        bos_token="<|begin_of_text|>",
        prompt_end="<|start_header_id|>assistant<|end_header_id|>\n\n",
        text='{"',
    )


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _client(
        tmp_path_factory.mktemp("mistral") / "mistral",
        chat_template=(TEMPLATES / "mistral_v3_tekken.jinja").read_text(),
        tekken=True,
        eos_token="</s>",
        prompt_end="[/INST]",
        text="[TOOL_CALLS]",
    )


def ask(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", USER)
    return client.chat.completions.create(model=_model(client), temperature=0, max_tokens=60, **kw)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _args(call: Any) -> Any:
    args = json.loads(call.function.arguments if hasattr(call, "function") else call.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # type: ignore[index]
    return args


# --- reasoning ------------------------------------------------------------------------------


def test_thinking_is_reasoning_content(thinking: openai.OpenAI) -> None:
    r = ask(thinking)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Let me think."
    assert msg.content == "Hello there"
    assert r.usage.completion_tokens_details.reasoning_tokens == 6  # <think> ... </think>


def test_constraint_applies_after_the_thinking(thinking: openai.OpenAI) -> None:
    r = ask(thinking, response_format=ANSWER_FORMAT)
    msg = r.choices[0].message
    # The thinking was free (it is no JSON), and the answer after `</think>` is the schema's.
    assert msg.model_extra["reasoning_content"] == "Let me think."
    jsonschema.validate(json.loads(msg.content), ANSWER)


def test_thinking_streams_apart(thinking: openai.OpenAI) -> None:
    reasoning, content = "", ""
    for chunk in ask(thinking, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("Let me think.", "Hello there")


def test_thinking_switched_off_constrains_from_the_first_token(thinking: openai.OpenAI) -> None:
    r = ask(
        thinking,
        response_format=ANSWER_FORMAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(msg.content), ANSWER)


def test_responses_reasoning_item(thinking: openai.OpenAI) -> None:
    model = _model(thinking)
    r = thinking.responses.create(model=model, input="Hi", temperature=0, max_output_tokens=40)
    rsn, msg = r.output
    assert rsn.type == "reasoning" and rsn.content[0].text == "Let me think."
    assert msg.type == "message" and r.output_text == "Hello there"
    assert r.usage.output_tokens_details.reasoning_tokens == 6
    with thinking.responses.stream(model=model, input="Hi", temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.reasoning_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == "Let me think." and final.output_text == "Hello there"


# --- Llama 3 JSON calls ---------------------------------------------------------------------


def test_llama3_auto_call(llama3: openai.OpenAI) -> None:
    r = ask(llama3, tools=[WEATHER], parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and _args(call)["city"] in CITY["enum"]
    assert r.choices[0].finish_reason == "tool_calls"


def test_llama3_required_and_named(llama3: openai.OpenAI) -> None:
    r = ask(llama3, tools=[PING, WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = ask(llama3, tools=[PING, WEATHER], tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and _args(call)


def test_llama3_streamed_call(llama3: openai.OpenAI) -> None:
    pieces, names = [], []
    for chunk in ask(llama3, tools=[WEATHER], parallel_tool_calls=False, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            names += [tc.function.name] if tc.function.name else []
            pieces.append(tc.function.arguments or "")
    assert names == ["get_weather"] and len(pieces) > 1
    assert json.loads("".join(pieces))["city"] in CITY["enum"]


# --- Mistral calls --------------------------------------------------------------------------


def test_mistral_auto_call(mistral: openai.OpenAI) -> None:
    r = ask(mistral, tools=[WEATHER], parallel_tool_calls=False)
    msg = r.choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and _args(call)
    assert len(call.id) == 9 and call.id.isalnum()
    assert not msg.content

    # The call goes back into the conversation: Mistral's template refuses (400) ids that are not
    # nine characters. (The prompt now ends in `[/TOOL_RESULTS]`, where the script says: stop.)
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    again = ask(mistral, messages=history, tools=[WEATHER], parallel_tool_calls=False)
    assert again.choices[0].finish_reason == "stop"


def test_mistral_required_named_and_responses(mistral: openai.OpenAI) -> None:
    r = ask(mistral, tools=[WEATHER, PING], tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    (call,) = ask(mistral, tools=[WEATHER, PING], tool_choice=named).choices[0].message.tool_calls
    assert call.function.name == "get_weather" and _args(call)
    flat = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    resp = mistral.responses.create(
        model=_model(mistral),
        input=USER[0]["content"],
        tools=[flat],
        parallel_tool_calls=False,
        temperature=0,
    )
    (fc,) = resp.output
    assert fc.type == "function_call" and fc.name == "get_weather" and _args(fc)
