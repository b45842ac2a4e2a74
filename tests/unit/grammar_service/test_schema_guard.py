"""The output check runs only what is safe: references resolve inside the schema as sent (nothing
is fetched or opened), and patterns are matched in linear time (never by a backtracking engine).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import regex

from grammar_service.schema.checks import OutputChecks, new_validator
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from tests.support.listeners import (
    Listener,
    external_schemas,
    file_proves_itself,
    unread,
    watched_file,
)
from tests.unit.grammar_service.schema_support import compile_schema, walk

HOSTILE = "(a+)+c|a+b"  # Python's `re` takes ~2^n steps on n `a`s then `b`
A27B = "a" * 27 + "b"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@contextlib.contextmanager
def no_backtracking() -> Iterator[None]:
    """Python's `re` and the `regex` package refuse every pattern compiled meanwhile (their
    caches hold only patterns compiled before)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a backtracking engine was asked to compile {args[:1]!r}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(re, "_compile", refuse)
        mp.setattr(regex, "compile", refuse)
        mp.setattr(regex, "search", refuse)
        yield


# -- patterns ---------------------------------------------------------------------------------

# (schema, an instance, whether it is valid): every place a pattern meets the output.
PATTERN_CASES: list[tuple[str, dict[str, Any], Any, bool]] = [
    ("pattern", {"type": "string", "pattern": HOSTILE}, A27B, True),
    ("pattern-no-match", {"type": "string", "pattern": "(a+)+c"}, A27B, False),
    ("not-pattern", {"type": "string", "not": {"pattern": "(a+)+c"}}, A27B, True),
    ("property-names", {"type": "object", "propertyNames": {"pattern": HOSTILE}}, {A27B: 1}, True),
    (
        "pattern-properties",
        {"type": "object", "patternProperties": {"(a+)+c": {"type": "string"}}},
        {A27B: 1},
        True,
    ),
    (
        "additional-properties",
        {"type": "object", "patternProperties": {"(a+)+c": {}}, "additionalProperties": False},
        {A27B: 1},
        False,
    ),
    (
        "unevaluated-properties",
        {
            "type": "object",
            "allOf": [{"patternProperties": {"(a+)+c": {}}}],
            "unevaluatedProperties": False,
        },
        {A27B: 1},
        False,
    ),
    (
        "unevaluated-properties-matched",
        {
            "type": "object",
            "allOf": [{"patternProperties": {HOSTILE: {}}}],
            "unevaluatedProperties": False,
        },
        {A27B: 1},
        True,
    ),
    # Compiling this with Python's `re` takes ~5 ms per class (case folding over the range).
    ("format-regex", {"format": "regex"}, "(?i)" + "[\u0100-\U0010ffff]" * 40, True),
    ("format-regex-invalid", {"format": "regex"}, "^(abc]", False),
    ("unicode-property", {"pattern": "^\\p{Letter}+$"}, "héllo", True),
    ("unicode-property-no-match", {"pattern": "^\\p{Letter}+$"}, "h1", False),
    (
        "unicode-escape",
        {"patternProperties": {"^\\u00e1": {"type": "integer"}}},
        {"áx": "s"},
        False,
    ),
    ("script", {"pattern": "^\\p{Script=Greek}+$"}, "αβγ", True),
    # Properties RE2 lacks are spelt out from the `regex` package's Unicode tables.
    ("binary-property", {"pattern": "^[\\p{Alphabetic}0-9]+$"}, "ab1", True),
    ("binary-property-no-match", {"pattern": "^\\p{Alphabetic}+$"}, "ab1", False),
    ("negated-property", {"pattern": "^\\P{White_Space}+$"}, "a\u00a0b", False),
    # `\s` is Unicode white space, as llguidance enforces it (RE2's own is ASCII only).
    ("unicode-space", {"pattern": "^a\\sb$"}, "a\u3000b", True),
    ("ascii-digits", {"pattern": "^\\d+$"}, "\u0661\u0662", False),
]


@pytest.mark.parametrize(
    ("schema", "instance", "ok"),
    [pytest.param(s, i, ok, id=name) for name, s, i, ok in PATTERN_CASES],
)
def test_patterns_never_reach_a_backtracking_engine(
    schema: dict[str, Any], instance: Any, ok: bool
) -> None:
    checks = OutputChecks(schema, {})  # builds the Unicode tables `regex` gives, if any
    t0 = time.monotonic()
    with no_backtracking():
        err = checks.document_error(instance)
    assert (err is None) is ok, err
    assert err is None or "cannot validate" not in err, err
    # Python's `re` takes seconds on these (27 `a`s: ~2^27 steps); RE2 microseconds.
    assert time.monotonic() - t0 < 2.0


def test_hostile_patterns_are_matched_in_linear_time(tok: Tokenizer) -> None:
    """Grammar plus output check, token by token, on schemas whose patterns backtrack."""
    schemas = [
        {"type": "string", "enum": [A27B], "pattern": HOSTILE},
        {"type": "string", "enum": [A27B], "not": {"pattern": "(a+)+c"}},
        {
            "type": "object",
            "properties": {A27B: {"type": "integer"}},
            "required": [A27B],
            "additionalProperties": False,
            "propertyNames": {"pattern": HOSTILE},
        },
    ]
    outputs = [json.dumps(A27B), json.dumps(A27B), json.dumps({A27B: 7})]
    for schema, text in zip(schemas, outputs, strict=True):
        t0 = time.monotonic()
        compiled = compile_schema(schema, tok, whitespace_flexible=False)
        walked = walk(compiled, tok, text)
        assert walked.accepted and walked.masked_off is None, (schema, walked)
        assert time.monotonic() - t0 < 5.0, schema  # the old engine: seconds per check


# Patterns RE2 cannot run: llguidance refuses them too, so they are refused wherever they are.
UNRUNNABLE: list[tuple[str, dict[str, Any], str, str]] = [
    ("lookahead-under-not", {"not": {"pattern": "(?=a)b"}}, "'pattern' at #/not", "lookahead"),
    (
        "backreference-in-property-names",
        {"type": "object", "propertyNames": {"pattern": "(a)\\1"}},
        "'pattern' at #/propertyNames",
        "backreference",
    ),
    (
        "lookbehind-pattern-property",
        {"type": "object", "patternProperties": {"(?<=a)b": {}}},
        "'patternProperties' at #",
        "lookbehind",
    ),
    (
        "named-backreference-under-if",
        {"if": {"pattern": "(?<x>a)\\k<x>"}, "then": {"minLength": 2}},
        "'pattern' at #/if",
        "backreference",
    ),
]


@pytest.mark.parametrize(
    ("schema", "where", "what"),
    [pytest.param(s, w, x, id=name) for name, s, w, x in UNRUNNABLE],
)
def test_patterns_re2_cannot_run_are_refused_up_front(
    tok: Tokenizer, schema: dict[str, Any], where: str, what: str
) -> None:
    with pytest.raises(RpcError) as e:
        compile_schema(schema, tok)
    err = e.value
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "UNSUPPORTED_CONSTRAINT", err.message
    field, description = err.violations[0]
    assert field == "constraint.json_schema"
    assert description.startswith(where) and f"{what} is not supported" in description


@pytest.mark.parametrize("pattern", ["a++b", "\\p{Nonsense}", "(", "a{2,1}"])
def test_invalid_patterns_under_not_are_refused(tok: Tokenizer, pattern: str) -> None:
    """Not ECMA-262 patterns either; under `not` the old check ignored them silently."""
    with pytest.raises(RpcError) as e:
        compile_schema({"type": "string", "not": {"pattern": pattern}}, tok)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.reason == "INVALID_CONSTRAINT", e.value.message
    assert e.value.violations[0][1].startswith("'pattern' at #/not: "), e.value.violations


# -- references -------------------------------------------------------------------------------


def test_references_outside_the_schema_are_refused_and_never_fetched(
    tok: Tokenizer, tmp_path: Path
) -> None:
    schema_file = watched_file(tmp_path)
    with Listener(answer=True) as counting, Listener(answer=False) as silent:
        urls = [counting.url, silent.url, schema_file.as_uri()]
        for url in urls:
            for schema in external_schemas(url):
                t0 = time.monotonic()
                with pytest.raises(RpcError) as e:
                    compile_schema(schema, tok)
                assert time.monotonic() - t0 < 5.0  # a fetch from `silent` would hang
                err = e.value
                assert err.code is grpc.StatusCode.INVALID_ARGUMENT
                assert err.reason == "INVALID_CONSTRAINT", err.message
                assert url in err.message and "never fetched" in err.message, err.message
                assert err.violations[0][0] == "constraint.json_schema"
            # The validator itself never retrieves either (the last line, behind the refusal).
            with pytest.raises(Exception, match="Unresolvable"):
                new_validator({"not": {"$ref": url}}).is_valid(1)
        assert counting.connections == 0 and silent.connections == 0
        assert unread(schema_file)
        counting.proves_itself()
    file_proves_itself(schema_file)


def test_references_inside_the_schema_resolve(tok: Tokenizer) -> None:
    """Pointers, anchors, `$id`s (relative ones against their base) and the bundled
    metaschemas, also where only the output check sees them."""
    schemas: list[tuple[dict[str, Any], str, str]] = [
        (
            {"type": "integer", "not": {"$ref": "#/$defs/neg"}, "$defs": {"neg": {"maximum": -1}}},
            "5",
            "-5",
        ),
        (
            {
                "type": "integer",
                "not": {"$ref": "#neg"},
                "$defs": {"n": {"$anchor": "neg", "maximum": -1}},
            },
            "5",
            "-5",
        ),
        (
            {
                "$id": "https://example.com/root.json",
                "type": "integer",
                "not": {"$ref": "neg.json"},
                "$defs": {"n": {"$id": "neg.json", "maximum": -1}},
            },
            "5",
            "-5",
        ),
        (
            {"type": "object", "not": {"$ref": "https://json-schema.org/draft/2020-12/schema"}},
            '{"type": 5}',
            '{"type": "string"}',
        ),
    ]
    for schema, good, bad in schemas:
        compiled = compile_schema(schema, tok, whitespace_flexible=False)
        assert walk(compiled, tok, good).accepted, (schema, good)
        assert not walk(compiled, tok, bad).accepted, (schema, bad)
