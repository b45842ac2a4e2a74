"""The gateway with the real `openai` client against a live stack (grammar service + worker +
gateway, embedded SmolLM2; the stack is shared with this package's other modules, `conftest.py`).
Every JSON output is checked with `jsonschema` (FormatChecker)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.support.metrics import metric, settled
from tests.support.processes import ServiceProcess, free_port, running
from tests.support.processes import openai_client as sdk

MODEL = "SmolLM2-135M-Instruct"
FORMATS = jsonschema.FormatChecker()


def ask(client: openai.OpenAI, content: str, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_and_health(client: openai.OpenAI, gw: ServiceProcess) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    with urllib.request.urlopen(f"http://{gw.address}/health") as r:
        health = json.load(r)
    assert health["status"] == "ok" and health["workers"][0]["model"] == MODEL


def test_plain_chat_and_completion(client: openai.OpenAI) -> None:
    r = ask(client, "What is the capital of France?", max_tokens=12)
    assert "Paris" in (r.choices[0].message.content or "")
    c = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert c.choices[0].text.startswith(" Paris")


def _strict(schema: Any) -> Any:
    """The schema as OpenAI's strict mode reads it: no undeclared properties anywhere."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


SCHEMAS: dict[str, tuple[dict[str, Any], bool, str]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
        },
        True,
        "Describe a person as JSON.",
    ),
    "enum_bool": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "bright": {"type": "boolean"},
            },
            "required": ["color", "bright"],
        },
        True,
        "Pick a color.",
    ),
    "pattern_number": (
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["code", "score"],
        },
        True,
        "Give an airport code and a score.",
    ),
    "date_format": (
        {
            "type": "object",
            "properties": {"day": {"type": "string", "format": "date"}},
            "required": ["day"],
        },
        True,
        "When was the moon landing?",
    ),
    "nested_closed": (
        {
            "type": "object",
            "properties": {
                "city": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 10},
                        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                    },
                    "required": ["name", "population"],
                    "additionalProperties": False,
                },
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        False,
        "Describe Paris.",
    ),
    "any_of": (
        {
            "type": "object",
            "properties": {
                "v": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 99},
                        {"type": "string", "maxLength": 5},
                    ]
                }
            },
            "required": ["v"],
        },
        False,
        "Give a value.",
    ),
    "array_top": (
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 4,
        },
        False,
        "List some digits.",
    ),
    "open_object": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 15},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            },
            "required": ["title"],
        },
        False,
        "Name a movie.",
    ),
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client: openai.OpenAI, name: str) -> None:
    schema, strict, prompt = SCHEMAS[name]
    r = ask(
        client,
        prompt,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": strict},
        },
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    value = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(value, _strict(schema) if strict else schema, format_checker=FORMATS)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_sdk_parse_with_pydantic_model(client: openai.OpenAI) -> None:
    # The SDK turns the model into a strict json_schema and parses the answer back.
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=60,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_object(client: openai.OpenAI) -> None:
    r = ask(client, 'Return {"ok": true}', response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,9}"}}, r"[A-Z][a-z]{2,9}"),
        ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, r"\d{3}-\d{4}"),
        ({"structured_outputs": {"choice": ["Paris", "London", "Berlin"]}}, "Paris|London|Berlin"),
        ({"guided_choice": ["yes", "no"]}, "yes|no"),
        (
            {"structured_outputs": {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}},
            r"The answer is (yes|no)\.",
        ),
        (
            {"structured_outputs": {"grammar": 'start: N " + " N\nN: /[0-9]{1,3}/'}},
            r"[0-9]{1,3} \+ [0-9]{1,3}",
        ),
    ],
)
def test_regex_choice_grammar_extras(
    client: openai.OpenAI, extra: dict[str, Any], check: str
) -> None:
    r = ask(client, "What is the capital of France?", max_tokens=20, extra_body=extra)
    out = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(check, out), out


def test_completions_with_constraint_and_usage(client: openai.OpenAI) -> None:
    c = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}},
    )
    assert c.choices[0].text in (" yes", " no")
    ids = [504, 3575, 282, 4649, 314]
    c = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.usage is not None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ids), 5)
    assert c.usage.total_tokens == len(ids) + 5
    assert c.choices[0].finish_reason == "length"


def test_streamed_content_matches_and_counts_usage(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": SCHEMA_SPEC},
        # Its own cache salt: no slot an earlier test left holds a shorter prefix to reuse.
        "extra_body": {"cache_salt": "streamed-content"},
    }
    whole = ask(client, "Describe a person as JSON.", **kw)
    text, usage, finish, roles = "", None, None, []
    for ch in ask(
        client,
        "Describe a person as JSON.",
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    ):
        if ch.choices:
            delta = ch.choices[0].delta
            roles.append(delta.role)
            text += delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage
    assert roles[0] == "assistant"
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and whole.usage is not None
    counts = usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
    assert counts == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    # The same prompt again: the worker's prefix cache held all of it but its last token.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    jsonschema.validate(json.loads(text), SCHEMAS["person"][0])


def test_a_conversation_s_next_turn_reuses_the_answer(
    client: openai.OpenAI, worker_metrics_port: int
) -> None:
    """The worker rewrites a finished answer into its KV slot while idle; the next turn, whose
    prompt renders that answer as the assistant's message, then computes only what follows."""
    refreshed = "maskwire_worker_refreshed_answer_tokens_total"
    # Earlier tests' answers are rewritten first: then the next pass is this answer's.
    before = settled(worker_metrics_port, refreshed)
    history = [
        {"role": "system", "content": "You are the desk of a ferry line. Answer briefly."},
        {"role": "user", "content": "Do you take bicycles on the morning crossing?"},
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=24, temperature=0
    )
    assert first.usage is not None
    answer = first.choices[0].message.content or ""
    deadline = time.monotonic() + 30
    while metric(worker_metrics_port, refreshed) - before < first.usage.completion_tokens:
        assert time.monotonic() < deadline, "the answer was never refreshed"
        time.sleep(0.02)
    history += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And dogs?"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt and answer (its end-of-turn token included).
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1, (
        cached,
        first.usage,
        answer,
    )
    assert cached < second.usage.prompt_tokens


SCHEMA_SPEC = {"name": "person", "schema": SCHEMAS["person"][0], "strict": True}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 30}},
                "required": ["timezone"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"] for t in TOOLS}


def check_calls(calls: list[tuple[str, str]]) -> None:
    """Every call names a known tool and its arguments validate against that tool's schema."""
    for name, arguments in calls:
        fn = PARAMS[name]
        schema = _strict(fn["parameters"]) if fn.get("strict") else fn["parameters"]
        jsonschema.validate(json.loads(arguments), schema, format_checker=FORMATS)


def message_calls(r: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]


WEATHER_Q = "What is the weather in Paris?"


def _call(i: int, city: str) -> dict[str, Any]:
    args = json.dumps({"city": city, "unit": "celsius"})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": args},
            }
        ],
    }


# SmolLM2-135M does not call tools unprompted; two earlier calls in the conversation make it.
FEW_SHOT = [
    {"role": "user", "content": "Weather in London?"},
    _call(1, "London"),
    {"role": "user", "content": "Weather in Rome?"},
    _call(2, "Rome"),
    {"role": "user", "content": "Weather in Paris?"},
]


def test_tool_choice_required(client: openai.OpenAI) -> None:
    r = ask(client, WEATHER_Q, tools=TOOLS, tool_choice="required")
    calls = message_calls(r)
    assert calls and r.choices[0].finish_reason == "tool_calls"
    check_calls(calls)
    r = ask(client, WEATHER_Q, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(message_calls(r)) == 1
    check_calls(message_calls(r))


def test_tool_choice_named(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = ask(client, "What time is it in Tokyo?", tools=TOOLS, tool_choice=choice)
    calls = message_calls(r)
    assert [n for n, _ in calls] == ["get_time"]
    check_calls(calls)


def test_tool_choice_auto_calls_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=FEW_SHOT, tools=TOOLS, temperature=0, max_tokens=40
    )  # type: ignore[call-overload]
    calls = message_calls(r)
    assert calls, r.choices[0].message.content
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(calls)
    # Without the nudge the model answers in text; whatever it does, calls would be valid.
    r = ask(client, WEATHER_Q, tools=TOOLS, max_tokens=16)
    check_calls(message_calls(r))
    if not message_calls(r):
        assert r.choices[0].message.content


def test_tool_choice_auto_not_parallel(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=FEW_SHOT,
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
        parallel_tool_calls=False,
    )  # type: ignore[call-overload]
    calls = message_calls(r)
    assert len(calls) == 1
    check_calls(calls)


def test_tool_choice_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=FEW_SHOT,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=20,
    )  # type: ignore[call-overload]
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def _streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for ch in stream:
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                entry["id"] = tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert all(c["id"].startswith("call_") for c in calls.values())
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    calls, finish = _streamed_calls(
        client.chat.completions.create(
            model=MODEL, messages=FEW_SHOT, tools=TOOLS, temperature=0, max_tokens=40, stream=True
        )  # type: ignore[call-overload]
    )
    assert calls and finish == "tool_calls"
    check_calls(calls)
    calls, finish = _streamed_calls(
        ask(client, WEATHER_Q, tools=TOOLS, tool_choice="required", stream=True)
    )
    assert calls and finish == "tool_calls"
    check_calls(calls)


# ------------------------------------------------------------------------------- errors


def test_invalid_schema_is_400_with_reason(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(
            client,
            "x",
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}},
        )
    body = e.value.body
    assert isinstance(body, dict)
    assert "strin" in body["message"] and body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "x", extra_body={"structured_outputs": {"regex": "[a-"}})
    assert isinstance(e.value.body, dict) and "regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        ask(client, "x", extra_body={"structured_outputs": {"grammar": "start: (("}})
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "x", tools=[bad_tool], tool_choice="required")
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "tools"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"


def test_malformed_body_is_422(gw: ServiceProcess) -> None:
    r = httpx.post(f"http://{gw.address}/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "messages"


def test_no_worker_is_503() -> None:
    with running("gateway", ["--worker", f"127.0.0.1:{free_port()}"], http=True) as g:
        with pytest.raises(openai.InternalServerError) as e:
            ask(sdk(g), "x")
        assert e.value.status_code == 503


def test_deadline_is_504(worker: ServiceProcess) -> None:
    with running(
        "gateway", ["--worker", worker.address, "--request-timeout-s", "1"], http=True
    ) as g:
        with pytest.raises(openai.InternalServerError) as e:
            ask(sdk(g), "Tell a long story.", max_tokens=1500, extra_body={"ignore_eos": True})
        assert e.value.status_code == 504


def test_overload_is_429(worker: ServiceProcess) -> None:
    with running("gateway", ["--worker", worker.address, "--max-concurrency", "1"], http=True) as g:
        c = sdk(g)
        holder = ask(c, "Tell a long story.", max_tokens=300, stream=True)
        try:
            next(iter(holder))  # admitted and generating
            with pytest.raises(openai.RateLimitError) as e:
                ask(c, "x", max_tokens=2)
            assert e.value.status_code == 429
        finally:
            holder.close()


def _abort_count(port: int) -> float:
    """Requests the worker finished with ABORT (its Prometheus counter)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("maskwire_worker_requests_total{") and 'finish_reason="abort"' in line
    )


def test_client_disconnect_aborts_on_worker(
    client: openai.OpenAI, worker_metrics_port: int
) -> None:
    before = _abort_count(worker_metrics_port)
    stream = ask(
        client, "Tell a long story.", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    # 1500 tokens take over a minute here; the abort must come long before that.
    deadline = time.monotonic() + 30
    while _abort_count(worker_metrics_port) <= before:
        assert time.monotonic() < deadline, "the worker did not abort the request"
        time.sleep(0.2)


def test_openapi_document(gw: ServiceProcess) -> None:
    from openapi_spec_validator import validate

    doc = httpx.get(f"http://{gw.address}/openapi.json").json()
    validate(doc)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert path in doc["paths"]


def test_schema_layer_takes_what_the_grammar_cannot_and_says_so(
    client: openai.OpenAI, gw: ServiceProcess
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "version": {"type": "string", "format": "semver"},
            "card": {"type": "string"},
            "billing": {"type": "string"},
        },
        "required": ["tags"],
        "dependentRequired": {"card": ["billing"]},
    }
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tag this article about cats."}],
        "temperature": 0,
        "max_tokens": 80,
        "response_format": rf,
    }
    r = httpx.post(f"http://{gw.address}/v1/chat/completions", json=body, timeout=300)
    # A duplicate string item can always be avoided by writing on (the check refuses only the
    # quote that would close a duplicate): no dead end, so never `constraint_unsatisfied`.
    assert r.status_code == 200, r.text
    header = r.headers["x-maskwire-schema-enforcement"]
    assert header.startswith("mode=complete; validated")
    assert "rewritten=dependentRequired" in header and "runtime=uniqueItems" in header
    assert "annotation=format" in header
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(content), schema)
    else:  # the model tags on (`feline`, `feline_cat`, ...) until max_tokens
        assert choice["finish_reason"] == "length"
        tags = re.findall(r'"([^"\\]*)"', content.split("[", 1)[1])  # the closed items
        assert len(tags) >= 2 and len(set(tags)) == len(tags), content
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "x", response_format=rf, extra_body={"schema_mode": "strict"})
    # strict mode refuses it: the unknown format first, naming where (then uniqueItems, ...)
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "unsupported_constraint"
    assert "'format' at #/properties/version" in e.value.body["message"]
    strict = {
        "type": "json_schema",
        "json_schema": {
            "name": "s",
            "strict": True,
            "schema": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},
        },
    }
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "x", response_format=strict)
    assert isinstance(e.value.body, dict) and "required property 'b'" in e.value.body["message"]
