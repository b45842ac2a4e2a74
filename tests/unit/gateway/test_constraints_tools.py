"""Request fields -> Constraint protos; tool modes and the schemas they constrain with."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gateway import constraints, schemas, tools
from gateway.errors import APIError
from gateway.tool_formats import FORMATS
from gateway.tools import ToolMode
from maskwire.v1 import common_pb2

MODEL = "m"


def chat(**kw: Any) -> schemas.ChatCompletionRequest:
    return schemas.ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def spec(**kw: Any) -> constraints.ConstraintSpec | None:
    return constraints.from_request(chat(**kw))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_text_and_nothing_are_unconstrained() -> None:
    assert spec() is None
    assert spec(response_format={"type": "text"}) is None


def test_json_schema_strict_forbids_additional_properties() -> None:
    s = spec(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
        }
    )
    assert s is not None
    c = s.constraint
    assert c.WhichOneof("kind") == "json_schema"
    assert json.loads(c.json_schema) == SCHEMA
    assert c.json_options.additional_properties == common_pb2.ADDITIONAL_PROPERTIES_FORBID
    assert not c.json_options.whitespace_flexible
    assert s.param == "response_format.json_schema.schema"


def test_json_schema_not_strict_keeps_json_schema_semantics() -> None:
    s = spec(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    )
    assert s is not None
    assert s.constraint.json_options.additional_properties == (
        common_pb2.ADDITIONAL_PROPERTIES_UNSPECIFIED
    )


def test_json_object() -> None:
    s = spec(response_format={"type": "json_object"})
    assert s is not None and s.constraint.json_object


@pytest.mark.parametrize(
    ("so", "kind", "value"),
    [
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"grammar": 'root ::= "a"'}, "gbnf", 'root ::= "a"'),
        ({"grammar": 'start: "a"'}, "lark", 'start: "a"'),
        ({"json": SCHEMA}, "json_schema", SCHEMA),
        ({"json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"json_object": True}, "json_object", True),
    ],
)
def test_structured_outputs(so: dict[str, Any], kind: str, value: Any) -> None:
    s = spec(structured_outputs=so)
    assert s is not None
    c = s.constraint
    assert c.WhichOneof("kind") == kind
    got: Any = getattr(c, kind)
    if kind == "choice":
        got = list(got.choices)
    elif kind == "json_schema":
        got = json.loads(got)
    assert got == value


def test_guided_aliases() -> None:
    s = spec(guided_regex="a+")
    assert s is not None and s.constraint.regex == "a+" and s.param == "guided_regex"
    s = spec(guided_choice=["x"])
    assert s is not None and list(s.constraint.choice.choices) == ["x"]


def test_whitespace_flexible_is_a_request_option() -> None:
    s = spec(structured_outputs={"json": SCHEMA, "whitespace_flexible": True})
    assert s is not None and s.constraint.json_options.whitespace_flexible


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
        ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
    ],
)
def test_bad_constraints_are_400_naming_the_field(kw: dict[str, Any], param: str | None) -> None:
    with pytest.raises(APIError) as e:
        spec(**kw)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/place"}},
            "required": ["where"],
            "$defs": {"place": {"type": "object", "properties": {"tz": {"type": "string"}}}},
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}


def test_plan_modes() -> None:
    assert tools.plan(chat()).mode is ToolMode.NONE
    assert tools.plan(chat(tools=[WEATHER])).mode is ToolMode.AUTO
    assert tools.plan(chat(tools=[WEATHER], tool_choice="none")).mode is ToolMode.NONE
    assert tools.plan(chat(tools=[WEATHER], tool_choice="required")).mode is ToolMode.REQUIRED
    p = tools.plan(
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert p.mode is ToolMode.NAMED and p.named == "get_weather"
    assert not tools.plan(chat(tools=[WEATHER], parallel_tool_calls=False)).parallel


@pytest.mark.parametrize(
    "kw",
    [
        {"tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [WEATHER, WEATHER]},
    ],
)
def test_plan_contradictions_are_400(kw: dict[str, Any]) -> None:
    with pytest.raises(APIError) as e:
        tools.plan(chat(**kw))
    assert e.value.status == 400


def _constraint(tp: tools.ToolPlan) -> common_pb2.Constraint | None:
    return FORMATS["hermes"].output(tp).constraint


def _required_schema(parallel: bool) -> dict[str, Any]:
    c = _constraint(
        tools.plan(
            chat(tools=[WEATHER, TIME, PING], tool_choice="required", parallel_tool_calls=parallel)
        )
    )
    assert c is not None and c.WhichOneof("kind") == "json_schema"
    assert c.json_options.additional_properties == common_pb2.ADDITIONAL_PROPERTIES_UNSPECIFIED
    schema: dict[str, Any] = json.loads(c.json_schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def test_required_schema_accepts_valid_calls_and_rejects_invalid() -> None:
    v = jsonschema.Draft202012Validator(_required_schema(parallel=True))
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
        {"name": "get_time", "arguments": {"where": {"tz": "UTC"}}},
        {"name": "ping", "arguments": {}},
    ]
    assert v.is_valid(good)
    assert not v.is_valid([])
    assert not v.is_valid([{"name": "get_weather", "arguments": {}}])  # city required
    assert not v.is_valid([{"name": "nope", "arguments": {}}])
    assert not v.is_valid([{"name": "get_time", "arguments": {"where": {"tz": "UTC", "x": 1}}}])
    assert not v.is_valid([{"name": "ping", "arguments": {}, "extra": 1}])


def test_required_without_parallel_allows_one_call() -> None:
    v = jsonschema.Draft202012Validator(_required_schema(parallel=False))
    one = {"name": "ping", "arguments": {}}
    assert v.is_valid([one])
    assert not v.is_valid([one, one])


def test_named_constrains_with_the_tools_parameters() -> None:
    c = _constraint(
        tools.plan(
            chat(
                tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_time"}},
            )
        )
    )
    assert c is not None
    schema = json.loads(c.json_schema)
    assert schema["additionalProperties"] is False  # strict tool
    assert schema["$defs"]["place"]["additionalProperties"] is False


def test_auto_uses_one_structural_tag_per_tool() -> None:
    c = _constraint(tools.plan(chat(tools=[WEATHER, PING])))
    assert c is not None and c.WhichOneof("kind") == "structural_tags"
    st = c.structural_tags
    assert list(st.triggers) == ["<tool_call>"]
    assert [t.begin for t in st.tags] == [
        '<tool_call>{"name": "get_weather", "arguments": ',
        '<tool_call>{"name": "ping", "arguments": ',
    ]
    assert all(t.end == "}</tool_call>" for t in st.tags)
    assert json.loads(st.tags[1].json_schema) == {"type": "object", "properties": {}}
    for t in st.tags:
        assert t.begin.startswith(st.triggers[0])


def test_none_has_no_constraint() -> None:
    assert _constraint(tools.plan(chat(tools=[WEATHER], tool_choice="none"))) is None


def test_forbid_additional_walks_nested_schemas() -> None:
    s: dict[str, Any] = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "object", "properties": {}}},
            "b": {"anyOf": [{"properties": {"c": {}}}, {"type": "string"}]},
            "d": {"type": "object", "additionalProperties": True},
        },
    }
    tools.forbid_additional(s)
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["items"]["additionalProperties"] is False
    assert s["properties"]["b"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["b"]["anyOf"][1]
    assert s["properties"]["d"]["additionalProperties"] is True


def test_tool_schema_with_foreign_ref_is_400() -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"$ref": "#"}}},
        },
    }
    with pytest.raises(APIError):
        _constraint(tools.plan(chat(tools=[bad], tool_choice="required")))
