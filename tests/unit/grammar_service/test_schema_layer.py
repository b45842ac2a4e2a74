"""The schema layer, keyword by keyword: how it is enforced (the report), and what the grammar
plus output check accept and refuse."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from grammar_service.compiler import STRICT
from grammar_service.schema.layer import prepare
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2
from tests.unit.grammar_service.schema_support import compile_schema, walk

GRAMMAR = common_pb2.ENFORCEMENT_GRAMMAR
REWRITTEN = common_pb2.ENFORCEMENT_REWRITTEN
RUNTIME = common_pb2.ENFORCEMENT_RUNTIME
ANNOTATION = common_pb2.ENFORCEMENT_ANNOTATION


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


OBJ3 = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}

# (schema, the keyword, how it is enforced, [(instance, valid)])
CASES: list[tuple[dict[str, Any], str, int, list[tuple[Any, bool]]]] = [
    (
        {"type": "object", "properties": OBJ3, "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
        REWRITTEN,
        [({"a": 1, "b": 2}, True), ({"a": 1}, False), ({"c": 1}, True), ({}, True)],
    ),
    (
        {"type": "object", "properties": OBJ3, "dependencies": {"a": ["c"]}},
        "dependencies",
        REWRITTEN,
        [({"a": 1, "c": 2}, True), ({"a": 1, "b": 2}, False)],
    ),
    (
        {
            "type": "object",
            "properties": OBJ3,
            "dependentSchemas": {"a": {"properties": {"b": {"minimum": 5}}}},
        },
        "dependentSchemas",
        REWRITTEN,
        [({"a": 1, "b": 5}, True), ({"a": 1, "b": 4}, False), ({"b": 4}, True)],
    ),
    (
        {"type": "object", "properties": OBJ3, "not": {"required": ["a", "b"]}},
        "not",
        REWRITTEN,
        [({"a": 1, "b": 2}, False), ({"a": 1}, True), ({"b": 1, "c": 1}, True)],
    ),
    ({"not": {"type": ["string", "object"]}}, "not", REWRITTEN, [("x", False), (1, True)]),
    (
        {"enum": ["a", "b", "c"], "not": {"enum": ["b"]}},
        "not",
        REWRITTEN,
        [("a", True), ("b", False)],
    ),
    (
        {
            "type": "object",
            "properties": {"kind": {"enum": ["a", "b"]}, "x": {}, "y": {}},
            "required": ["kind"],
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"required": ["x"]},
            "else": {"required": ["y"]},
        },
        "if",
        REWRITTEN,
        [
            ({"kind": "a", "x": 1}, True),
            ({"kind": "a", "y": 1}, False),
            ({"kind": "b", "y": 1}, True),
            ({"kind": "b", "x": 1}, False),
        ],
    ),
    (
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        "oneOf",
        REWRITTEN,
        [("x", True), (3, True), (None, False)],
    ),
    (
        {
            "oneOf": [
                {"properties": {"k": {"const": "p"}, "n": {"type": "integer"}}, "required": ["k"]},
                {"properties": {"k": {"const": "q"}, "s": {"type": "string"}}, "required": ["k"]},
            ]
        },
        "oneOf",
        REWRITTEN,
        [({"k": "p", "n": 1}, True), ({"k": "q", "s": "x"}, True), ({"k": "r"}, False)],
    ),
    (
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "oneOf",
        RUNTIME,
        [(20, True), (-3, True), (5, False)],
    ),
    (
        {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
        "uniqueItems",
        REWRITTEN,
        [(["a", "b"], True), (["b"], True), ([], True), (["a", "a"], False)],
    ),
    (
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "uniqueItems",
        RUNTIME,
        [(["a", "b"], True), (["a", "b", "a"], False)],
    ),
    (
        {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
        "uniqueItems",
        RUNTIME,
        [([{"a": 1}, {"a": 2}], True), ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], False)],
    ),
    ({"type": "string", "format": "semver"}, "format", ANNOTATION, [("not a version", True)]),
    (
        {"type": "string", "format": "json-pointer"},
        "format",
        REWRITTEN,
        [("/a/b", True), ("/a~", False), ("a", False)],
    ),
    (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        "propertyNames",
        REWRITTEN,
        [({"ab": 1}, True), ({"Ab": 1}, False)],
    ),
    (
        {"type": "object", "propertyNames": {"enum": ["a", "b"]}},
        "propertyNames",
        REWRITTEN,
        [({"a": 1, "b": 1}, True), ({"c": 1}, False)],
    ),
    (
        {"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}},
        "propertyNames",
        RUNTIME,
        [({"ab": 1}, True), ({"abcd": 1}, False), ({"b": 1}, False)],
    ),
    (
        {"type": "object", "properties": {"a": {}}, "maxProperties": 1},
        "maxProperties",
        RUNTIME,
        [({"a": 1}, True), ({"b": 1}, True), ({"a": 1, "b": 2}, False)],
    ),
    (
        {"type": "object", "properties": {"a": {}}, "minProperties": 2},
        "minProperties",
        RUNTIME,
        [({"a": 1, "b": 1}, True), ({"a": 1}, False)],
    ),
    (
        {"type": "array", "contains": {"const": 1}, "maxContains": 1},
        "contains",
        RUNTIME,
        [([2, 1], True), ([2], False), ([1, 1], False)],
    ),
    (
        {"type": "object", "not": {"properties": {"a": {"const": 1}}, "required": ["a"]}},
        "not",
        RUNTIME,
        [({"a": 2}, True), ({"a": 1}, False)],
    ),
    (
        {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
        "unevaluatedProperties",
        REWRITTEN,
        [({"a": 1}, True), ({"b": 1}, False)],
    ),
    (
        {"type": "array", "maxItems": 2.0},
        "maxItems",
        REWRITTEN,
        [([1, 2], True), ([1, 2, 3], False)],
    ),
]


@pytest.mark.parametrize(("schema", "keyword", "how", "instances"), CASES)
def test_keyword_enforcement(
    tok: Tokenizer,
    schema: dict[str, Any],
    keyword: str,
    how: int,
    instances: list[tuple[Any, bool]],
) -> None:
    compiled = compile_schema(schema, tok)
    report = compiled.report
    assert (
        report is not None and report.validated and report.mode == common_pb2.SCHEMA_MODE_COMPLETE
    )
    assert (keyword, how) in {(k.keyword, k.enforcement) for k in report.keywords}
    for value, ok in instances:
        walked = walk(compiled, tok, json.dumps(value))
        assert walked.accepted == ok, value
        if ok:  # the output check never masks off a token of a valid instance
            assert walked.masked_off is None, value


def test_formats_are_steered_by_the_grammar_not_checked_as_they_complete(tok: Tokenizer) -> None:
    # llguidance's own date format admits 2021-02-29, which the rule's validator refuses: the
    # layer's pattern leaves it out, so the grammar never starts an answer it could not end.
    compiled = compile_schema({"type": "string", "format": "date"}, tok)
    assert compiled.checks is not None and not compiled.checks.tracked
    assert walk(compiled, tok, '"2024-02-29"').accepted
    walked = walk(compiled, tok, '"2021-02-29"')
    assert not walked.accepted and walked.masked_off is not None


def test_report_lists_grammar_keywords_and_locations(tok: Tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "uniqueItems": True, "format": "semver"}},
    }
    report = compile_schema(schema, tok).report
    assert report is not None
    assert set(report.grammar_keywords) == {"type", "properties"}
    entries = {(k.keyword, k.location, k.enforcement) for k in report.keywords}
    assert entries == {
        ("uniqueItems", "#/properties/tags", RUNTIME),
        ("format", "#/properties/tags", ANNOTATION),
    }


def test_strict_mode_refuses_and_reports_grammar_only(tok: Tokenizer) -> None:
    with pytest.raises(RpcError) as info:
        compile_schema({"type": "array", "uniqueItems": True}, tok, mode=STRICT)
    assert info.value.reason == "UNSUPPORTED_CONSTRAINT"
    compiled = compile_schema({"type": "array", "items": {"type": "integer"}}, tok, mode=STRICT)
    assert compiled.checks is None and compiled.report is not None
    assert compiled.report.mode == STRICT and not compiled.report.keywords
    assert set(compiled.report.grammar_keywords) == {"type", "items"}


def test_openai_strict_names_the_required_property_it_cannot_have(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}
    with pytest.raises(RpcError) as info:
        compile_schema(schema, tok, additional_properties=common_pb2.ADDITIONAL_PROPERTIES_FORBID)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "required property 'b' at #" in info.value.message and "strict" in info.value.message
    compile_schema(schema, tok)  # without strict, `b` may be an additional property


def test_structural_tags_take_rewrites_but_refuse_run_time_keywords(tok: Tokenizer) -> None:
    def tags(schema: dict[str, Any]) -> common_pb2.Constraint:
        tag = common_pb2.StructuralTag(begin="<t>", json_schema=json.dumps(schema), end="</t>")
        return common_pb2.Constraint(structural_tags=common_pb2.StructuralTags(tags=[tag]))

    from grammar_service.compiler import compile_constraint
    from grammar_service.config import ParserLimits

    ok = compile_constraint(tags({"type": "string", "format": "semver"}), tok, ParserLimits())
    assert ok.report is not None and ok.report.keywords[0].location == "tags[0]#"
    with pytest.raises(RpcError) as info:
        compile_constraint(tags({"type": "array", "uniqueItems": True}), tok, ParserLimits())
    assert info.value.reason == "UNSUPPORTED_CONSTRAINT" and "structural tags" in info.value.message


def test_overlapping_patterns_fall_back_to_one_checked_pattern(tok: Tokenizer) -> None:
    schema = {"type": "object", "patternProperties": {"a": {"type": "integer"}, "b": {}}}
    compiled = compile_schema(schema, tok)
    assert compiled.report is not None
    assert ("patternProperties", RUNTIME) in {
        (k.keyword, k.enforcement) for k in compiled.report.keywords
    }
    assert walk(compiled, tok, '{"ab": 1}').accepted
    assert not walk(compiled, tok, '{"ab": "x"}').accepted


def test_references_into_dropped_keywords_still_resolve() -> None:
    schema = {"allOf": [{"$ref": "#/not/not"}], "not": {"not": {"type": "integer"}}}
    out = prepare(schema, common_pb2.SCHEMA_MODE_COMPLETE).schema
    assert "not" not in json.dumps(out)
    target = out["allOf"][0]["$ref"]
    assert target.startswith("#/$defs/") and out["$defs"][target.split("/")[-1]] == {
        "type": "integer"
    }


def test_patterns_of_intersected_objects_fold_into_the_check(tok: Tokenizer) -> None:
    schema = {
        "type": "object",
        "allOf": [
            {"patternProperties": {"a": {"type": "integer"}}},
            {"patternProperties": {"b": {"type": "string"}}},
        ],
    }
    compiled = compile_schema(schema, tok)
    assert walk(compiled, tok, '{"a": 1, "b": "x"}').accepted
    assert not walk(compiled, tok, '{"ab": 1}').accepted  # must be an integer and a string


def test_string_regexes_llguidance_cannot_intersect_are_checked(tok: Tokenizer) -> None:
    schema = {"type": "string", "pattern": "^([a-z][0-9])+$", "minLength": 10000}
    compiled = compile_schema(schema, tok)
    assert compiled.report is not None
    assert ("minLength", RUNTIME) in {(k.keyword, k.enforcement) for k in compiled.report.keywords}
    assert not walk(compiled, tok, '"a1b2"').accepted  # too short: the output check says so


def test_intersections_keep_one_recursive_reference() -> None:
    tree = {"type": "object", "additionalProperties": {"$ref": "#/$defs/t"}}
    schema = {
        "$defs": {"t": tree, "u": {"additionalProperties": {"$ref": "#/$defs/u"}}},
        "allOf": [{"$ref": "#/$defs/t"}, {"$ref": "#/$defs/u"}, {"minProperties": 1}],
    }
    prepared = prepare(schema, common_pb2.SCHEMA_MODE_COMPLETE, relax=frozenset({"intersections"}))
    assert prepared.schema["allOf"] == [{"$ref": "#/$defs/t"}, {"minProperties": 1}]
    assert prepared.runtime == {"#/allOf/1": frozenset({"allOf"})}
