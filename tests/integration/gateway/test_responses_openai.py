"""The Responses API and the SDK's `parse` helpers with the official `openai` client against the
live SmolLM2 stack (`conftest.py`). Every structured output is validated with `jsonschema` or
pydantic."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"tz": {"type": "string", "maxLength": 30}},
        "required": ["tz"],
    },
}


def create(client: openai.OpenAI, input: Any, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    return client.responses.create(model=MODEL, input=input, **kw)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


def test_text_answer_with_instructions_and_usage(client: openai.OpenAI) -> None:
    # Its own cache salt: no slot an earlier test left holds a shorter prefix to reuse.
    salted = {"extra_body": {"cache_salt": "capital-of-france"}}
    r = create(client, "What is the capital of France?", **salted)
    assert r.status == "completed" and "Paris" in r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens < 40
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = create(client, "What is the capital of France?", **salted)
    # The worker's prefix cache held all of the repeated prompt but its last token.
    assert again.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1
    assert again.output_text == r.output_text
    short = create(
        client, "Tell a long story.", instructions="You tell stories.", max_output_tokens=5
    )
    assert short.status == "incomplete" and short.usage.output_tokens == 5
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.instructions == "You tell stories." and short.output_text


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        model=MODEL,
        input=[{"role": "user", "content": "Describe a person as JSON."}],
        text_format=Person,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(r.output_parsed, Person)


def test_streamed_json_object(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input='Return {"ok": true} as JSON.',
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=30,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert isinstance(json.loads(deltas), dict) and deltas == final.output_text
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_round_trip(client: openai.OpenAI) -> None:
    r = create(
        client, "What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice="required"
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls
    for call in calls:
        schema = WEATHER_PARAMS if call.name == "get_weather" else TIME["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)

    named = create(
        client,
        "What time is it in Tokyo?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
    )
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME["parameters"])

    # The response's output and the tool's result go back as input; the model answers in text.
    answer = create(
        client,
        [
            {"role": "user", "content": "What time is it in Tokyo?"},
            *[item.model_dump(exclude_none=True) for item in named.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "09:30"},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_output_tokens=20,
    )
    assert answer.output_text


def test_streamed_function_call_arguments(client: openai.OpenAI) -> None:
    events = list(
        create(
            client,
            "What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMS)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "strin"}}}},
            "text.format.schema",
        ),
    ],
)
def test_refusals_name_the_field(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(client, "Hi", **kw)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def test_chat_completions_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    calls = r.choices[0].message.tool_calls or []
    assert calls and all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)
