"""Reasoning: when the output starts with thinking, and how it is split from the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reasoning import ReasoningSplitter, end_marker
from gateway.tool_formats.hermes import parser as hermes_parser
from gateway.tool_parser import Merged, PlainText

THINK_TEMPLATE = "...{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}..."


def test_marker_only_for_thinking_templates_whose_prompt_leaves_thinking_open() -> None:
    assert end_marker("<|im_start|>{{ m }}", "<|im_start|>assistant\n") == ""
    assert end_marker(THINK_TEMPLATE, "<|im_start|>assistant\n") == "</think>"
    assert end_marker(THINK_TEMPLATE, "<|im_start|>assistant\n<think>\n") == "</think>"
    # Thinking switched off: the prompt closes the section, the whole output is the answer.
    assert end_marker(THINK_TEMPLATE, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == ""


def split(chunks: list[str], *, plain: bool = False) -> Merged:
    s = ReasoningSplitter(PlainText() if plain else hermes_parser())
    m = Merged()
    for c in chunks:
        m.add(s.feed(c))
    m.add(s.finish())
    return m


@pytest.mark.parametrize(
    "text",
    [
        "<think>\nLet me see.\n</think>\n\nHello",  # the model opens the section
        "\nLet me see.\n</think>Hello",  # the prompt opened it
    ],
)
def test_reasoning_then_answer(text: str) -> None:
    m = split([text], plain=True)
    assert m.reasoning.strip() == "Let me see."
    assert m.content == "Hello"


def test_cut_short_while_thinking_is_all_reasoning() -> None:
    m = split(["<think>hmm </thi"], plain=True)
    assert m.reasoning == "hmm </thi"
    assert m.content == ""


def test_tags_in_the_answer_are_the_formats() -> None:
    m = split(
        ['<think>call <tool_call>?</think><tool_call>{"name": "f", "arguments": {}}</tool_call>']
    )
    assert m.reasoning == "call <tool_call>?"
    assert [(c.name, json.loads(c.arguments)) for c in m.calls] == [("f", {})]
    assert m.content == ""


TEXT = '<think>a <b> </thin c</think>\n\n{"x": "</think>"}'


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_any_chunking_same_split(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [TEXT[a:b] for a, b in zip([0, *points], [*points, len(TEXT)], strict=True)]
    m = split(chunks, plain=True)
    assert m.reasoning == "a <b> </thin c"
    assert m.content == '{"x": "</think>"}'
