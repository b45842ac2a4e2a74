"""Constraint shape bounds: what llguidance would recurse over, measured without recursion."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from grammar_service.bounds import grammar_shape, schema_shape
from grammar_service.compiler import compile_constraint
from grammar_service.config import ConstraintBounds, ParserLimits
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def ref_chain(n: int) -> dict[str, Any]:
    """A query of death: `d0: array of $ref d1`, ..., `dn: integer`."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def test_schema_depth_follows_refs_and_cuts_cycles() -> None:
    # root -> $defs -> d0 -> items -($ref)-> d1 -> ... -> d10: two containers per hop.
    assert schema_shape(ref_chain(10))[0] == 1 + 1 + 2 * 10 + 1
    recursive = {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    }
    depth, nodes = schema_shape(recursive)
    assert (depth, nodes) == (5, 5)  # root, $defs, node, properties, next: a cycle, not a chain
    assert schema_shape({"type": "string"}) == (1, 1)
    assert schema_shape({"$ref": "https://example.com/remote"}) == (1, 1)  # not followed


def test_schema_shape_of_a_very_deep_chain_does_not_recurse() -> None:
    depth, nodes = schema_shape(ref_chain(50_000))
    assert depth > 100_000 and nodes > 100_000


def test_grammar_shape_counts_rule_chains_not_strings_or_schemas() -> None:
    assert grammar_shape(lark_chain(40)) == (42, 42)
    text = (
        "// r9 in a comment\n"
        'start: "r0 r1" /r2|r3/ item\n'
        'item: %json { "properties": {"start": {"type": "string"}} } | ITEM\n'
        'ITEM: "x"\n'
    )
    depth, rules = grammar_shape(text)
    assert (depth, rules) == (3, 3)


@pytest.mark.parametrize(
    ("constraint", "flag"),
    [
        (common_pb2.Constraint(json_schema=json.dumps(ref_chain(3000))), "--max-schema-depth"),
        (common_pb2.Constraint(lark=lark_chain(3000)), "--max-grammar-depth"),
        (
            common_pb2.Constraint(lark="start: %json " + json.dumps(ref_chain(3000))),
            "--max-schema-depth",
        ),
        (
            common_pb2.Constraint(
                gbnf="root ::= r0\n"
                + "".join(f"r{i} ::= r{i + 1}\n" for i in range(600))
                + 'r600 ::= "a"\n'
            ),
            "--max-grammar-depth",
        ),
    ],
)
def test_deep_chains_are_refused_before_compiling(
    tok: Tokenizer, constraint: common_pb2.Constraint, flag: str
) -> None:
    with pytest.raises(RpcError) as info:
        compile_constraint(constraint, tok, ParserLimits())
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "CONSTRAINT_TOO_COMPLEX"
    assert flag in err.message
    assert err.violations[0][0].startswith("constraint.")


def test_bounds_are_flags(tok: Tokenizer) -> None:
    narrow = ConstraintBounds(max_schema_depth=8, max_grammar_rules=2, max_choices=2)
    schema = common_pb2.Constraint(json_schema=json.dumps(ref_chain(5)))
    compile_constraint(schema, tok, ParserLimits())  # fine with the defaults
    with pytest.raises(RpcError, match="at most 8"):
        compile_constraint(schema, tok, ParserLimits(), bounds=narrow)
    with pytest.raises(RpcError, match="--max-grammar-rules"):
        compile_constraint(
            common_pb2.Constraint(lark=lark_chain(3)), tok, ParserLimits(), bounds=narrow
        )
    with pytest.raises(RpcError, match="--max-choices"):
        compile_constraint(
            common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["a", "b", "c"])),
            tok,
            ParserLimits(),
            bounds=narrow,
        )


def test_thousands_of_choices_compile_and_match(tok: Tokenizer) -> None:
    # As Earley alternatives, 3,000 choices passed the parser's items-per-row limit and every
    # token was refused; as one terminal they compile in milliseconds.
    choices = [f"item number {i}" for i in range(3000)]
    compiled = compile_constraint(
        common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=choices)), tok, ParserLimits()
    )
    for text in ("item number 2999", "item number 7"):
        m = compiled.new_matcher()
        assert m.consume_tokens(tok.ll.tokenize_str(text)), m.get_error()
        assert m.is_accepting()
    m = compiled.new_matcher()
    assert not m.consume_tokens(tok.ll.tokenize_str("item number 3000"))
