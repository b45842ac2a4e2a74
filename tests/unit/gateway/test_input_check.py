"""gateway.input_check: nesting depth and lone surrogates, found anywhere, named by their path."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.input_check import (
    _nesting_depth,
    check_body,
    check_numbers,
    check_value,
    parse_json_text,
)


def nested(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def refusal(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_plain_values_pass() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo 😀"}], "stop": ["\n"]}
    check_value(body, (), 8)
    check_value(nested(8), (), 8)
    raw = json.dumps(body).encode()
    check_body(raw, json.loads(raw), 8)


def test_lone_surrogate_is_named_by_its_path() -> None:
    body = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]}
    err = refusal(check_value, body, (), 64)
    assert err.code == "invalid_unicode" and err.param == "messages[1].content"
    assert "lone UTF-16 surrogate" in err.message
    err = refusal(check_value, {"logit_bias": {"\udfff": 1}}, (), 64)
    assert err.param == "logit_bias.\\udfff"  # the key itself, escaped
    assert "object key" in err.message


def test_one_of_several_bad_fields_is_reported() -> None:
    err = refusal(check_value, {"a": ["\ud800"], "b": "\ud801"}, (), 64)
    assert err.param in ("a[0]", "b")


def test_depth_names_the_field_not_the_leaf() -> None:
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]}
    err = refusal(check_value, body, (), 64)
    assert err.code == "nesting_too_deep"
    assert err.param == "tools[0].function.parameters"
    assert "64" in err.message and len(err.message) < 1000


def test_check_body_finds_surrogates_as_escapes_or_as_raw_bytes() -> None:
    for raw in (b'{"model": "\\ud800"}', b'{"model": "\xed\xa0\x80"}'):
        body = json.loads(raw)  # json.loads lets both through
        assert refusal(check_body, raw, body, 64).param == "model"
    paired = b'{"model": "\\ud83d\\ude00"}'  # a valid pair: one emoji
    check_body(paired, json.loads(paired), 64)
    check_body(b'{"model": "x"}', {"model": "\ud800"}, 64)  # the bytes cannot hold one: unchecked
    for raw in (b'"\\udc00"', b'"\\ud800x"', b'"\\\\ud83d\\ude00"'):  # lone low, high; `\\`
        assert refusal(check_body, raw, json.loads(raw), 64).code == "invalid_unicode"
    utf16 = '{"model": "x"}'.encode("utf-16")
    check_body(utf16, json.loads(utf16), 64)
    utf16 = '{"model": "\ud800"}'.encode("utf-16", "surrogatepass")
    assert refusal(check_body, utf16, json.loads(utf16), 64).param == "model"
    utf16 = json.dumps({"a": nested(10)}).encode("utf-16-le")
    assert refusal(check_body, utf16, json.loads(utf16), 8).code == "nesting_too_deep"


def test_check_body_walks_only_when_the_bytes_say_so() -> None:
    raw = json.dumps({"a": [[[1]]], "b": "[[[[[[{{{{", "c": [[], {}, [1]]}).encode()
    check_body(raw, nested(100), 4)  # not walked (the value would fail if it were)
    err = refusal(check_body, raw, json.loads(raw), 3)
    assert err.param == "a[0][0]"
    wide = json.dumps([[[[1]]] for _ in range(10_000)]).encode()
    check_body(wide, nested(100), 4)
    assert refusal(check_body, wide, json.loads(wide), 3).code == "nesting_too_deep"


def test_json_text_in_a_field() -> None:
    assert parse_json_text('{"type": "string"}', "guided_json", 64) == {"type": "string"}
    with pytest.raises(json.JSONDecodeError):
        parse_json_text("{nope", "guided_json", 64)
    deep = '{"a":' * 100 + "1" + "}" * 100
    err = refusal(parse_json_text, deep, "structured_outputs.json", 64)
    assert err.param == "structured_outputs.json" and err.code == "nesting_too_deep"
    too_deep_to_parse = "[" * 100_000 + "]" * 100_000
    err = refusal(parse_json_text, too_deep_to_parse, "structured_outputs.json", 64)
    assert err.param == "structured_outputs.json"
    err = refusal(parse_json_text, '{"d": "\\ud800"}', "guided_json", 64)
    assert err.param == "guided_json.d" and err.code == "invalid_unicode"


@pytest.mark.parametrize(
    ("text", "value"),
    [("5", 5), ("true", True), ("null", None), ('"s"', "s"), ("-0.5", -0.5), ("1e308", 1e308)],
)
def test_json_text_may_be_any_scalar(text: str, value: Any) -> None:
    assert parse_json_text(text, "guided_json", 64) == value


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ("NaN", "f"),
        ("-Infinity", "f"),
        ("1e999", "f"),
        ("-1e400", "f"),
        ("9" * 309, "f"),  # past the largest double
        ("9" * 5000, "f"),  # past what Python converts at all
        ('{"a": [1, {"b": NaN}]}', "f.a[1].b"),
        ('{"maximum": 1e999}', "f.maximum"),
    ],
)
def test_numbers_json_cannot_carry_are_named(text: str, param: str) -> None:
    err = refusal(parse_json_text, text, "f", 64)
    assert err.code == "invalid_number" and err.param == param, err.message
    assert len(err.message) < 1000


def test_numbers_in_range_pass() -> None:
    big = "1" + "0" * 300
    assert parse_json_text(f"[{big}, 1e-999, -1.7e308]", "f", 64) == [int(big), 0.0, -1.7e308]


def test_numbers_of_values_from_the_body() -> None:
    check_numbers({"maximum": 10**300, "d": "9" * 400}, "s", 64)  # long digits in a string pass
    for value, param in (
        ({"maximum": float("nan")}, "s.maximum"),
        ({"anyOf": [{"minimum": -float("inf")}]}, "s.anyOf[0].minimum"),
        ({"maximum": 10**400}, "s.maximum"),
    ):
        err = refusal(check_numbers, value, "s", 64)
        assert err.code == "invalid_number" and err.param == param


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        ("x", 0),
        ([], 1),
        ({"a": '[[[\\"]]]{{'}, 1),  # brackets, an escaped quote, a backslash in a string
        (["\\", [['"[', "\\\\"]]], 3),
        ({'a\\"': [']\\"[', {"b": {}}]}, 4),
        ([[[[[[]]]]], [[]]], 6),
    ],
)
def test_nesting_depth_counts_only_brackets_outside_strings(value: Any, depth: int) -> None:
    assert _nesting_depth(json.dumps(value).encode()) == depth
    assert _nesting_depth(json.dumps(value, ensure_ascii=False, indent=2).encode()) == depth
