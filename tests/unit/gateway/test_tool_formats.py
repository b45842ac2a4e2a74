"""Tool-call formats: each mode's constraint compiles, accepts the format's own output and refuses
calls to unknown tools, and the format's parser reads the calls back; detection from real chat
templates; Mistral's call ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import cli, schemas, tools
from gateway.chat_template import ChatTemplate, build_prompt
from gateway.tool_formats import FORMATS, ToolFormat, detect
from gateway.tool_formats.mistral import TOOL_CALLS
from gateway.tool_parser import LeadingCallsParser, Merged, OutputParser
from grammar_service.compiler import compile_constraint
from grammar_service.config import ParserLimits
from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path
from maskwire.v1 import common_pb2
from tests.unit.gateway.fake_worker import CHATML

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
PARIS = {"city": "Paris"}


def chat(**kw: Any) -> schemas.ChatCompletionRequest:
    return schemas.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, PING]}
        | kw
    )


NAMED_PING = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def tokenizers() -> Iterator[dict[str, Tokenizer]]:
    smol = load_tokenizer("default")
    yield {"hermes": smol, "llama3_json": smol, "mistral": load_tokenizer(str(tekken_path()))}


def accepts(c: common_pb2.Constraint, tok: Tokenizer, text: str) -> bool:
    """Whether the whole of `text`, tokenized as the worker does, is a complete output."""
    m = compile_constraint(c, tok, ParserLimits()).new_matcher()
    ids = tok.encode(text)
    if tok.add_bos and ids[:1] == [tok.bos_token_id]:
        ids = ids[1:]
    return bool(m.consume_tokens(ids)) and not m.is_error() and m.is_accepting()


def read(parser: OutputParser, text: str) -> Merged:
    merged = Merged()
    merged.add(parser.feed(text))
    merged.add(parser.finish())
    return merged


def read_chunks(parser: OutputParser, text: str, cuts: list[int]) -> Merged:
    """`text` fed in pieces cut at `cuts`."""
    points = sorted(set(cuts))
    merged = Merged()
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        merged.add(parser.feed(text[a:b]))
    merged.add(parser.finish())
    return merged


def calls(m: Merged) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in m.calls]


def call(fmt: str, name: str, args: dict[str, Any]) -> str:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    return json.dumps({"name": name, key: args})


# (format, request fields, output text, content, calls)
CASES: list[tuple[str, dict[str, Any], str, str, list[tuple[str, Any]]]] = [
    (
        "hermes",
        {},
        f"Sure.<tool_call>{call('hermes', 'get_weather', PARIS)}</tool_call>",
        "Sure.",
        [("get_weather", PARIS)],
    ),
    ("hermes", {"tool_choice": "required"}, f"[{call('hermes', 'ping', {})}]", "", [("ping", {})]),
    (
        "hermes",
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        json.dumps(PARIS),
        "",
        [("get_weather", PARIS)],
    ),
    ("llama3_json", {}, "It is sunny.", "It is sunny.", []),
    ("llama3_json", {}, call("llama3_json", "get_weather", PARIS), "", [("get_weather", PARIS)]),
    (
        "llama3_json",
        {"tool_choice": "required"},
        f"{call('llama3_json', 'get_weather', PARIS)}; {call('llama3_json', 'ping', {})}",
        "",
        [("get_weather", PARIS), ("ping", {})],
    ),
    (
        "llama3_json",
        {"tool_choice": {"type": "function", "function": {"name": "ping"}}},
        call("llama3_json", "ping", {}),
        "",
        [("ping", {})],
    ),
    (
        "mistral",
        {},
        f"Let me look.{TOOL_CALLS}[{call('mistral', 'get_weather', PARIS)}]",
        "Let me look.",
        [("get_weather", PARIS)],
    ),
    ("mistral", {}, "No tool needed.", "No tool needed.", []),
    (
        "mistral",
        {"tool_choice": "required"},
        f"[{call('mistral', 'get_weather', PARIS)}, {call('mistral', 'ping', {})}]",
        "",
        [("get_weather", PARIS), ("ping", {})],
    ),
    (
        "mistral",
        {"tool_choice": {"type": "function", "function": {"name": "ping"}}},
        f"[{call('mistral', 'ping', {})}]",
        "",
        [("ping", {})],
    ),
]


@pytest.mark.parametrize(("fmt", "kw", "text", "content", "expected"), CASES)
def test_constraint_accepts_the_formats_output_and_parser_reads_it(
    tokenizers: dict[str, Tokenizer],
    fmt: str,
    kw: dict[str, Any],
    text: str,
    content: str,
    expected: list[tuple[str, Any]],
) -> None:
    out = FORMATS[fmt].output(tools.plan(chat(**kw)))
    assert out.constraint is not None
    assert accepts(out.constraint, tokenizers[fmt], text)
    m = read(out.parser(), text)
    assert m.content == content
    assert calls(m) == expected


@pytest.mark.parametrize(
    ("fmt", "kw", "text"),
    [
        ("hermes", {}, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
        ("llama3_json", {}, call("llama3_json", "nope", {})),
        ("llama3_json", {}, call("llama3_json", "get_weather", {"city": "Paris", "x": 1})),
        ("llama3_json", {"tool_choice": "required"}, "It is sunny."),
        (
            "llama3_json",
            {"tool_choice": "required", "parallel_tool_calls": False},
            f"{call('llama3_json', 'ping', {})}; {call('llama3_json', 'ping', {})}",
        ),
        ("mistral", {}, f"{TOOL_CALLS}[{call('mistral', 'nope', {})}]"),
        (
            "mistral",
            {"parallel_tool_calls": False},
            f"{TOOL_CALLS}[{call('mistral', 'ping', {})}, {call('mistral', 'ping', {})}]",
        ),
    ],
)
def test_constraint_refuses_what_the_tools_do_not_allow(
    tokenizers: dict[str, Tokenizer], fmt: str, kw: dict[str, Any], text: str
) -> None:
    out = FORMATS[fmt].output(tools.plan(chat(**kw)))
    assert out.constraint is not None
    assert not accepts(out.constraint, tokenizers[fmt], text)


def test_mistral_marker_is_the_special_token_not_its_spelling(
    tokenizers: dict[str, Tokenizer],
) -> None:
    tok = tokenizers["mistral"]
    out = FORMATS["mistral"].output(tools.plan(chat()))
    assert out.constraint is not None
    m = compile_constraint(out.constraint, tok, ParserLimits()).new_matcher()
    spelled = list(tok.ll.tokenize_str(TOOL_CALLS, parse_special=False))
    assert m.consume_tokens(spelled)  # free text: the letters are allowed, and start no call
    m.consume_tokens(tok.ll.tokenize_str('[{"name": "nope"', parse_special=False))
    assert not m.is_error()


def test_required_and_named_end_the_prompt_with_the_marker_where_the_format_has_one() -> None:
    required = tools.plan(chat(tool_choice="required"))
    assert FORMATS["mistral"].output(required).prompt_suffix == TOOL_CALLS
    assert FORMATS["hermes"].output(required).prompt_suffix == ""
    assert FORMATS["llama3_json"].output(required).prompt_suffix == ""
    # Hermes without parallel calls stops at the first closing tag.
    assert FORMATS["hermes"].output(tools.plan(chat(parallel_tool_calls=False))).stop == (
        "</tool_call>",
    )


def test_detected_from_the_chat_template() -> None:
    def fmt(name: str) -> ToolFormat:
        return detect((TEMPLATES / name).read_text())

    assert fmt("mistral_v3_tekken.jinja").name == "mistral"
    assert fmt("llama3_json.jinja").name == "llama3_json"
    assert fmt("chatml_think.jinja").name == "hermes"
    assert detect(CHATML).name == "hermes"


def test_cli_names_the_formats() -> None:
    assert set(cli.TOOL_CALL_PARSERS) == set(FORMATS)


def _conversation(call_id: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]


def test_mistral_template_gets_nine_character_ids() -> None:
    mistral = FORMATS["mistral"]
    ids = {mistral.new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert mistral.template_call_id("abcDEF123") == "abcDEF123"
    short = mistral.template_call_id("call_0123456789abcdef")
    assert len(short) == 9 and short.isalnum()
    assert short == mistral.template_call_id("call_0123456789abcdef")  # call and result match

    req = chat(messages=_conversation("call_0123456789abcdef"))
    template = ChatTemplate(
        (TEMPLATES / "mistral_v3_tekken.jinja").read_text(), bos_token="<s>", eos_token="</s>"
    )
    prompt = build_prompt(template, req, tools.plan(req), mistral)
    assert prompt.startswith('<s>[AVAILABLE_TOOLS][{"type": "function"')
    assert "[/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST]" in prompt
    assert (
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{short}"}}]'
        in prompt
    )
    assert prompt.endswith(
        f'[TOOL_RESULTS]{{"content": "sunny", "call_id": "{short}"}}[/TOOL_RESULTS]'
    )


def test_llama3_template_renders_calls_and_results() -> None:
    req = chat(messages=_conversation("call_1"))
    template = ChatTemplate(
        (TEMPLATES / "llama3_json.jinja").read_text(),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    prompt = build_prompt(template, req, tools.plan(req), FORMATS["llama3_json"])
    assert '{"name": <function name>, "parameters": <arguments as an object>}' in prompt
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris"}}<|eot_id|>' in prompt
    )
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("name", ["llama3_json", "mistral"])
def test_templates_without_tool_support_get_the_formats_instructions(name: str) -> None:
    req = chat(messages=_conversation("abcDEF123"))
    prompt = build_prompt(ChatTemplate(CHATML), req, tools.plan(req), FORMATS[name])
    fmt = FORMATS[name]
    assert fmt.instructions(req_tools(req)) in prompt
    key = "parameters" if name == "llama3_json" else "arguments"
    assert f'"name": "get_weather", "{key}": {{"city": "Paris"}}' in prompt


def req_tools(req: schemas.ChatCompletionRequest) -> tuple[schemas.Tool, ...]:
    return tuple(req.tools or ())


LLAMA_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "a}\\"b", "n": [1, {"x": 2}]}}; '
    '{"name": "ping", "parameters": {}}'
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(LLAMA_CALLS)), max_size=10))
def test_leading_calls_parser_any_chunking(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [
        LLAMA_CALLS[a:b] for a, b in zip([0, *points], [*points, len(LLAMA_CALLS)], strict=True)
    ]
    parser = LeadingCallsParser()
    merged = Merged()
    for c in chunks:
        merged.add(parser.feed(c))
    merged.add(parser.finish())
    assert merged.content == ""
    assert calls(merged) == [("get_weather", {"city": 'a}"b', "n": [1, {"x": 2}]}), ("ping", {})]


def test_leading_calls_parser_text_keeps_its_leading_whitespace() -> None:
    assert read(LeadingCallsParser(), "  \nHello {x}").content == "  \nHello {x}"
    assert read(LeadingCallsParser(), " \n").content == " \n"


MISTRAL_OUT = (
    f'Checking.{TOOL_CALLS}[{{"name": "get_weather", "arguments": {{"city": "a]\\"}}"}}}}, '
    '{"name": "ping", "arguments": {}}]'
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(MISTRAL_OUT)), max_size=10))
def test_mistral_parser_any_chunking(cuts: list[int]) -> None:
    merged = read_chunks(FORMATS["mistral"].output(tools.plan(chat())).parser(), MISTRAL_OUT, cuts)
    assert merged.content == "Checking."
    assert calls(merged) == [("get_weather", {"city": 'a]"}'}), ("ping", {})]
    assert all(len(c.id) == 9 for c in merged.calls)
