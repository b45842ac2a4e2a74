"""Tool-call parsers: the same text gives the same calls however the stream is chunked."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tool_formats.hermes import parser as hermes_parser
from gateway.tool_parser import (
    CallDelta,
    ContentDelta,
    Delta,
    JsonArrayCallParser,
    Merged,
    NamedCallParser,
    OutputParser,
)

TWO_CALLS = (
    'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": [1, 2]}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
    '{"tz": "Europe/Paris", "q": "a}\\"b"}}</tool_call>'
)


def run(parser: OutputParser, chunks: list[str]) -> tuple[Merged, list[Delta]]:
    merged = Merged()
    deltas: list[Delta] = []
    for c in chunks:
        d = parser.feed(c)
        deltas += d
        merged.add(d)
    d = parser.finish()
    deltas += d
    merged.add(d)
    return merged, deltas


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(text)]:
        out.append(text[prev:p])
        prev = p
    return out


def calls(m: Merged) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in m.calls]


def test_hermes_content_then_two_calls() -> None:
    m, _ = run(hermes_parser(), [TWO_CALLS])
    assert m.content == "Let me check.\n\n"
    assert calls(m) == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {"tz": "Europe/Paris", "q": 'a}"b'}),
    ]
    assert len({c.id for c in m.calls}) == 2
    assert all(c.id.startswith("call_") for c in m.calls)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(TWO_CALLS)), max_size=12))
def test_hermes_any_chunking_same_result(cuts: list[int]) -> None:
    whole, _ = run(hermes_parser(), [TWO_CALLS])
    m, deltas = run(hermes_parser(), split(TWO_CALLS, cuts))
    assert m.content == whole.content
    assert calls(m) == calls(whole)
    # Each call is announced once (id + name first), then only argument pieces follow.
    firsts = [d for d in deltas if isinstance(d, CallDelta) and d.id is not None]
    assert [d.index for d in firsts] == [0, 1]


def test_hermes_char_by_char_streams_arguments_incrementally() -> None:
    _, deltas = run(hermes_parser(), list(TWO_CALLS))
    pieces = [d for d in deltas if isinstance(d, CallDelta) and d.index == 0]
    assert len(pieces) > 10  # arguments arrive as they are generated, not at the end
    assert pieces[0].name == "get_weather"


def test_hermes_holds_back_partial_tag_only() -> None:
    p = hermes_parser()
    assert p.feed("Hello <tool_") == [ContentDelta("Hello ")]
    assert p.feed("box> x") == [ContentDelta("<tool_box> x")]
    assert p.finish() == []


def test_hermes_whitespace_inside_tag_and_parameters_alias() -> None:
    text = '<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>'
    m, _ = run(hermes_parser(), [text])
    assert m.content == ""
    assert calls(m) == [("f", {"a": 1})]


def test_hermes_arguments_given_as_json_string() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    m, _ = run(hermes_parser(), [text])
    assert calls(m) == [("f", {"a": 1})]


def test_hermes_not_a_call_is_given_back_as_content() -> None:
    text = "<tool_call>oops</tool_call> done"
    m, _ = run(hermes_parser(), list(text))
    assert m.calls == []
    assert m.content == text


def test_hermes_missing_arguments_becomes_empty_object() -> None:
    m, _ = run(hermes_parser(), ['<tool_call>{"name": "ping"}</tool_call>'])
    assert calls(m) == [("ping", {})]


def test_hermes_stop_string_cut_before_closing_tag() -> None:
    # parallel_tool_calls=false stops generation at `</tool_call>`, which is not returned.
    m, _ = run(hermes_parser(), ['<tool_call>{"name": "f", "arguments": {"x": true}}'])
    assert calls(m) == [("f", {"x": True})]


def test_hermes_truncated_call_keeps_partial_arguments() -> None:
    m, _ = run(hermes_parser(), ['<tool_call>{"name": "f", "arguments": {"x": "abc'])
    assert [c.name for c in m.calls] == ["f"]
    assert m.calls[0].arguments == '{"x": "abc'


def test_hermes_truncated_before_name_is_content() -> None:
    m, _ = run(hermes_parser(), ['hi <tool_call>{"na'])
    assert m.calls == []
    assert m.content == 'hi <tool_call>{"na'


ARRAY = '[{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}, {"arguments": {}, "name": "b"}]'


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(ARRAY)), max_size=10))
def test_json_array_any_chunking(cuts: list[int]) -> None:
    m, deltas = run(JsonArrayCallParser(), split(ARRAY, cuts))
    assert m.content == ""
    assert calls(m) == [("a", {"x": [1, {"y": "]"}]}), ("b", {})]
    assert not any(isinstance(d, ContentDelta) for d in deltas)


def test_json_array_scalar_arguments_and_whitespace() -> None:
    m, _ = run(JsonArrayCallParser(), list('[ { "name" : "n" , "arguments" : 5 } ]'))
    assert calls(m) == [("n", 5)]


def test_named_parser_whole_output_is_arguments() -> None:
    m, deltas = run(NamedCallParser("f"), ['{"a":', " 1}"])
    assert calls(m) == [("f", {"a": 1})]
    assert isinstance(deltas[0], CallDelta) and deltas[0].name == "f"
    assert all(isinstance(d, CallDelta) and d.id is None for d in deltas[1:])


def test_named_parser_empty_output_still_names_the_call() -> None:
    m, _ = run(NamedCallParser("f"), [])
    assert [(c.name, c.arguments) for c in m.calls] == [("f", "")]
