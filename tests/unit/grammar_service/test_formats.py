"""Every format jsonschema's checker knows is steered by the grammar: every string the grammar can
produce passes the check (so an answer never runs into a dead end after generating), and an
`exact` decision produces every string that passes. A format nothing steers is refused up front,
and strict mode refuses, naming where, the formats llguidance lacks."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_service.compiler import STRICT, compile_constraint
from grammar_service.config import ParserLimits
from grammar_service.schema import formats
from grammar_service.schema.formats import STEERS, checked_formats
from grammar_service.schema.layer import prepare
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2
from tests.unit.grammar_service.schema_support import compile_schema, sample, walk

REWRITTEN = common_pb2.ENFORCEMENT_REWRITTEN
ANNOTATION = common_pb2.ENFORCEMENT_ANNOTATION
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
PATTERNS = sorted(n for n, s in STEERS.items() if s.pattern)


def _alternatives() -> dict[str, Callable[[str], bool]]:
    """The checkers jsonschema uses for the same formats where the GPL rfc3987 is not installed
    (its `format-nongpl` extra, what maskwire depends on): the grammar must satisfy those too."""
    import rfc3986_validator
    import rfc3987_syntax

    return {
        "uri": lambda v: bool(rfc3986_validator.validate_rfc3986(v, rule="URI")),
        "uri-reference": lambda v: bool(
            rfc3986_validator.validate_rfc3986(v, rule="URI_reference")
        ),
        "iri": lambda v: bool(rfc3987_syntax.is_valid_syntax("iri", v)),
        "iri-reference": lambda v: bool(rfc3987_syntax.is_valid_syntax("iri_reference", v)),
    }


ALTERNATIVES = _alternatives()


def conforms(name: str, value: str) -> bool:
    alternative = ALTERNATIVES.get(name)
    return CHECKER.conforms(value, name) and (alternative is None or alternative(value))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def test_every_format_the_checker_knows_is_decided() -> None:
    assert checked_formats() <= set(STEERS)
    assert len(checked_formats()) >= 19  # jsonschema[format] in this environment
    for name, steer in STEERS.items():
        assert bool(steer.native) != bool(steer.pattern), name
        assert not steer.native or steer.native in formats.GRAMMAR_FORMATS


@pytest.mark.parametrize("name", PATTERNS)
@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_every_string_of_a_pattern_passes_the_check(name: str, data: st.DataObject) -> None:
    steer = STEERS[name]
    value = data.draw(st.from_regex(re.compile(steer.pattern), fullmatch=True))
    if steer.max_length is not None and len(value) > steer.max_length:
        return  # the grammar has maxLength beside the pattern
    assert conforms(name, value), value


@pytest.mark.parametrize("name", sorted(STEERS))
def test_what_the_grammar_produces_passes_the_check(tok: Tokenizer, name: str) -> None:
    """Random strings from the grammar the layer makes (compiled without the output check, which
    would hide an unsound grammar by masking end-of-text)."""
    prepared = prepare({"type": "string", "format": name}, common_pb2.SCHEMA_MODE_COMPLETE)
    assert not prepared.runtime  # the output check steers no format
    grammar_only = compile_schema(prepared.schema, tok, mode=STRICT)
    rng = random.Random(name)  # seeded: the same draws every run
    produced = [sample(grammar_only, tok, rng, limit=96) for _ in range(60)]
    assert not [s.text for s in produced if s.end == "dead_end"], name
    values = [json.loads(s.text) for s in produced if s.end == "eos"]
    assert values, name
    for value in values:
        assert conforms(name, value), (name, value)


def suite_strings(testdata: Path, name: str) -> list[str]:
    path = testdata / "json-schema-test-suite/tests/draft2020-12/optional/format" / f"{name}.json"
    return [
        t["data"]
        for g in json.loads(path.read_text())
        for t in g["tests"]
        if isinstance(t["data"], str)
    ]


EDGES = {
    "date": ["2024-02-29", "2000-02-29", "0004-02-29", "2021-02-29", "1900-02-29", "0000-01-01"],
    "date-time": ["2020-02-29t23:59:59.5z", "2021-12-31T23:59:60Z", "2021-02-29T00:00:00Z"],
    "time": ["23:59:59+23:59", "23:59:60Z", "24:00:00Z", "12:00:00"],
    "json-pointer": ["", "/", "/a~0~1/~", "a", "/~2"],
    "relative-json-pointer": ["0", "10#", "110/a", "100", "01", "0#/a"],
    "uri-reference": ["", "../x?y#z", "//[::1]:80/p", "a b", "http://x/%zz", ":x"],
    "iri-reference": ["//ü/ö?ä#ß", "../x", "a b"],
    "iri": ["http://ü.example/ö", "ü:", "//x"],
}


@pytest.mark.parametrize("name", PATTERNS)
def test_exact_patterns_are_the_checkers_language(testdata: Path, name: str) -> None:
    steer = STEERS[name]
    pattern = re.compile(steer.pattern)
    for value in [*suite_strings(testdata, name), *EDGES.get(name, [])]:
        matched = pattern.fullmatch(value) is not None
        if matched:
            assert conforms(name, value), value
        elif steer.exact:
            assert not CHECKER.conforms(value, name), value


# (format, strings the grammar must produce, strings it must refuse before they end)
PROBES: list[tuple[str, list[str], list[str]]] = [
    ("date", ["2024-02-29", "2000-02-29"], ["2021-02-29", "1900-02-29", "0000-01-01"]),
    ("date-time", ["2020-02-29T23:59:59.5Z"], ["2021-12-31T23:59:60Z", "2021-02-29T00:00:00Z"]),
    ("time", ["23:59:59+01:00"], ["23:59:60Z"]),
    (
        "hostname",
        ["a.b-c", ".".join(["a" * 63] * 3 + ["b" * 61])],
        [".".join(["a" * 63] * 4), "a_b"],
    ),
    ("idn-hostname", ["xn4.example"], ["ab--c", "-a"]),
    ("idn-email", ["실례@실례.테스트", "a.b@c"], ["a@", "@b"]),
    ("json-pointer", ["", "/a~0/b"], ["a", "/~2"]),
    ("relative-json-pointer", ["0", "10#", "11/a"], ["100", "01", "#"]),
    ("regex", ["^[a-z]+\\d{2}$", "(ab|c)*?"], ["*", "a(b", "[z-a]", "a**"]),
    ("uri-reference", ["../x?y#z", "http://[::1]/"], ["a b", "http://%zz"]),
    ("iri", ["http://ü.example/ö#ä"], ["ü", "http://a b"]),
    ("uri-template", ["/a/{b}{?c,d*}", "x{+y:3}"], ["{", "{a b}"]),
]


@pytest.mark.parametrize(("name", "good", "bad"), PROBES)
def test_the_grammar_refuses_what_cannot_pass(
    tok: Tokenizer, name: str, good: list[str], bad: list[str]
) -> None:
    compiled = compile_schema({"type": "string", "format": name}, tok)
    report = compiled.report
    assert report is not None and ("format", "#", REWRITTEN) in {
        (k.keyword, k.location, k.enforcement) for k in report.keywords
    }
    for value in good:
        walked = walk(compiled, tok, json.dumps(value, ensure_ascii=False))
        assert walked.accepted and walked.masked_off is None, value
    for value in bad:
        walked = walk(compiled, tok, json.dumps(value, ensure_ascii=False))
        assert not walked.accepted and walked.masked_off is not None, value


def test_a_format_beside_a_pattern_keeps_both(tok: Tokenizer) -> None:
    compiled = compile_schema({"type": "string", "format": "json-pointer", "pattern": "^/a"}, tok)
    assert walk(compiled, tok, '"/ab/c"').accepted
    assert not walk(compiled, tok, '"/b"').accepted
    assert not walk(compiled, tok, '"a"').accepted
    shorter = compile_schema({"type": "string", "format": "hostname", "maxLength": 5}, tok)
    assert walk(shorter, tok, '"ab.cd"').accepted
    assert not walk(shorter, tok, '"ab.cde"').accepted


def test_other_drafts_names_for_the_same_check_are_steered_and_other_checks_refused(
    tok: Tokenizer,
) -> None:
    d3 = "http://json-schema.org/draft-03/schema#"
    hosts = compile_schema({"$schema": d3, "type": "string", "format": "host-name"}, tok)
    assert not walk(hosts, tok, json.dumps("a" * 254)).accepted
    d4 = {"$schema": "http://json-schema.org/draft-04/schema#", "format": "date"}
    report = compile_schema(d4, tok).report  # draft 4's checker has no `date`: an annotation
    assert report is not None and report.keywords[0].enforcement == ANNOTATION
    for name in ("color", "time"):  # draft 3's own checks
        schema = {"$schema": d3, "properties": {"c": {"type": "string", "format": name}}}
        with pytest.raises(RpcError) as info:
            compile_schema(schema, tok)
        assert info.value.reason == "UNSUPPORTED_CONSTRAINT"
        assert info.value.violations[0][0] == "constraint.json_schema"
        assert f"'format' at #/properties/c: '{name}'" in info.value.message


def test_strict_mode_refuses_formats_llguidance_lacks_naming_where(tok: Tokenizer) -> None:
    schema = {"properties": {"u": {"type": "string", "format": "uri-reference"}}}
    with pytest.raises(RpcError) as info:
        compile_schema(schema, tok, mode=STRICT)
    assert info.value.reason == "UNSUPPORTED_CONSTRAINT"
    assert "'format' at #/properties/u: llguidance has no format 'uri-reference'" in (
        info.value.message
    )
    compile_schema({"type": "string", "format": "date"}, tok, mode=STRICT)
    compile_schema({"type": "string", "format": "unknown"}, tok, mode=STRICT)
    # llguidance's `lenient` ignores the formats it lacks: nothing to refuse then
    compile_schema(schema, tok, mode=STRICT, lenient=True)
    compile_schema({**schema, "x-guidance": {"lenient": True}}, tok, mode=STRICT)


def test_structural_tags_take_steered_formats(tok: Tokenizer) -> None:
    schema: dict[str, Any] = {"type": "string", "format": "json-pointer"}
    tag = common_pb2.StructuralTag(begin="<t>", json_schema=json.dumps(schema), end="</t>")
    constraint = common_pb2.Constraint(structural_tags=common_pb2.StructuralTags(tags=[tag]))
    compiled = compile_constraint(constraint, tok, ParserLimits())
    assert compiled.report is not None
    assert compiled.report.keywords[0].enforcement == REWRITTEN
