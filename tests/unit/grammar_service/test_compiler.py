from __future__ import annotations

import json

import grpc
import pytest

from grammar_service.compiler import compile_constraint, translate
from grammar_service.config import ParserLimits
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path
from maskwire.v1 import common_pb2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def test_json_defaults_are_compact(tok: Tokenizer) -> None:
    g = json.loads(translate(common_pb2.Constraint(json_schema='{"type": "object"}'), tok).grammar)
    opts = g["grammars"][0]["json_schema"]["x-guidance"]
    assert opts["whitespace_flexible"] is False
    assert (opts["item_separator"], opts["key_separator"]) == (", ", ": ")
    flex = common_pb2.Constraint(
        json_object=True, json_options=common_pb2.JsonOptions(whitespace_flexible=True)
    )
    opts = json.loads(translate(flex, tok).grammar)["grammars"][0]["json_schema"]["x-guidance"]
    assert opts["whitespace_flexible"] is True and opts["item_separator"] == ","


def test_structural_tags_use_lazy_trigger_for_non_special_text(tok: Tokenizer) -> None:
    st = common_pb2.StructuralTags(
        triggers=["<tool_call>"],
        tags=[common_pb2.StructuralTag(begin="<tool_call>", json_schema="{}", end="</tool_call>")],
    )
    lark = translate(common_pb2.Constraint(structural_tags=st), tok).grammar
    assert '"<tool_call>"' in lark and "[lazy]" in lark  # not a special-token reference
    st2 = common_pb2.StructuralTags(
        triggers=["<|im_start|>"],
        tags=[common_pb2.StructuralTag(begin="<|im_start|>", json_schema="{}", end="")],
    )
    lark2 = translate(common_pb2.Constraint(structural_tags=st2), tok).grammar
    assert "TAG_TEXT <|im_start|>" in lark2  # a real special token of SmolLM2


def test_structural_tag_trigger_on_a_special_token_named_by_id() -> None:
    """Mistral's `[TOOL_CALLS]` is one special token that Lark cannot name: it is matched by id,
    so the model's token triggers the tag (its spelling in ordinary tokens stays free text)."""
    tekken = load_tokenizer(str(tekken_path()))
    st = common_pb2.StructuralTags(
        triggers=["[TOOL_CALLS]"],
        tags=[
            common_pb2.StructuralTag(
                begin="[TOOL_CALLS]", json_schema='{"type": "array", "maxItems": 0}', end=""
            )
        ],
    )
    constraint = common_pb2.Constraint(structural_tags=st)
    assert "TAG_TEXT <[9]>" in translate(constraint, tekken).grammar
    grammar = compile_constraint(constraint, tekken, ParserLimits())
    m = grammar.new_matcher()
    assert m.consume_tokens(tekken.encode("Hi[TOOL_CALLS][]")[1:]) and m.is_accepting()
    m = grammar.new_matcher()
    m.consume_tokens(tekken.encode("Hi[TOOL_CALLS][1]")[1:])
    assert m.is_error()  # the array had to be empty


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (common_pb2.Constraint(json_schema="[1]"), "constraint.json_schema"),
        (
            common_pb2.Constraint(json_schema='{"minimum": "x", "type": "integer"}'),
            "constraint.json_schema",
        ),
        (
            common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["a", ""])),
            "constraint.choice.choices[1]",
        ),
        (common_pb2.Constraint(json_object=False), "constraint.json_object"),
        (
            common_pb2.Constraint(
                structural_tags=common_pb2.StructuralTags(
                    triggers=["<x>"], tags=[common_pb2.StructuralTag(begin="<y>", json_schema="{}")]
                )
            ),
            "constraint.structural_tags.tags[0].begin",
        ),
    ],
)
def test_errors_are_field_violations(
    tok: Tokenizer, constraint: common_pb2.Constraint, field: str
) -> None:
    with pytest.raises(RpcError) as info:
        compile_constraint(constraint, tok, ParserLimits())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == field
