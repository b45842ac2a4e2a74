"""A schema that is not a valid schema of its draft is refused before compiling: the keyword, its
location and the metaschema's verdict, agreeing with jsonschema's `check_schema`, in linear time,
without recursion and without fetching anything."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import referencing.exceptions

from grammar_service.compiler import COMPLETE, STRICT, compile_constraint
from grammar_service.config import ParserLimits
from grammar_service.schema.metaschema import problem
from grammar_service.schema.registry import OFFLINE
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
SUITE_DRAFTS = {
    "draft2020-12": None,
    "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
    "draft7": D7,
    "draft6": "http://json-schema.org/draft-06/schema#",
    "draft4": D4,
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def reference(schema: dict[str, Any]) -> str | None:
    """jsonschema's own verdict (check_schema without format assertions)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    err = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    return None if err is None else err.message


@pytest.mark.parametrize(
    ("schema", "keyword", "location", "message"),
    [
        ({"type": "string", "format": ["date"]}, "format", "#", "['date'] is not of type 'string'"),
        (
            {"properties": {"a": {"type": "strin"}}},
            "type",
            "#/properties/a",
            "'strin' is not valid",
        ),
        ({"type": "string", "minLength": -1}, "minLength", "#", "less than the minimum of 0"),
        ({"minLength": 2.5}, "minLength", "#", "2.5 is not of type 'integer'"),
        ({"required": ["a", "a"]}, "required", "#", "has non-unique elements"),
        ({"required": ["a", 5]}, "required", "#", "5 is not of type 'string' (at [1])"),
        ({"properties": []}, "properties", "#", "[] is not of type 'object'"),
        ({"properties": {"a": 5}}, "properties", "#/properties/a", "5 is not a schema"),
        ({"anyOf": []}, "anyOf", "#", "should be non-empty"),
        ({"allOf": [{}, {"not": 7}]}, "not", "#/allOf/1", "7 is not of type 'object', 'boolean'"),
        ({"items": [{}]}, "items", "#", "is not of type 'object', 'boolean'"),  # 2020-12
        ({"$schema": D7, "items": [{}, 5]}, "items", "#/items/1", "5 is not a schema"),
        ({"$schema": D4, "exclusiveMaximum": True}, "dependencies", "#", "'maximum' is a dep"),
        ({"$schema": D4, "items": True}, "items", "#", "not valid under any of the given"),
        ({"$schema": D4, "enum": [{"a": [1]}, {"a": [1.0]}]}, "enum", "#", "non-unique"),
        ({"$ref": 5}, "$ref", "#", "5 is not of type 'string'"),
        ({"multipleOf": 0}, "multipleOf", "#", "less than or equal to the minimum of 0"),
        ({"$schema": ["x"]}, "$schema", "#", "['x'] is not of type 'string'"),
    ],
)
def test_invalid_schemas_name_keyword_and_location(
    schema: dict[str, Any], keyword: str, location: str, message: str
) -> None:
    found = problem(schema)
    assert found is not None
    assert (found.keyword, found.location) == (keyword, location), found
    assert message in found.message, found
    if keyword != "$schema":  # jsonschema cannot even pick a draft for that one
        assert reference(schema) is not None


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "string", "format": "semver", "x-anything": [5]},
        {"minLength": 2.0, "enum": [1, 1.5, "1"], "const": None},
        {"$schema": D4, "enum": [1, True]},  # 1 and true differ in JSON Schema
        {"$schema": "https://example.com/own-dialect", "type": "string"},
        {"pattern": "(", "$defs": {"a": {"$ref": "http://127.0.0.1:9/x"}}},  # not resolved
    ],
)
def test_valid_schemas_pass(schema: dict[str, Any]) -> None:
    assert problem(schema) is None
    assert reference(schema) is None


def test_agrees_with_jsonschema_on_the_test_suite(testdata: Path) -> None:
    root = testdata / "json-schema-test-suite" / "tests"
    seen = 0
    for draft, uri in SUITE_DRAFTS.items():
        for path in sorted((root / draft).rglob("*.json")):
            for group in json.loads(path.read_text()):
                schema = group["schema"]
                if not isinstance(schema, dict):
                    continue
                if uri is not None and "$schema" not in schema:
                    schema = {**schema, "$schema": uri}
                found = problem(schema)
                assert (found is None) == (reference(schema) is None), (path.name, found)
                seen += 1
    assert seen > 700


def test_every_subschema_is_checked() -> None:
    """Wherever a subschema sits, keyword by keyword, each is checked."""
    bad = {"type": "strin"}
    for schema, where in (
        ({"$defs": {"x": bad}}, "#/$defs/x"),
        ({"dependentSchemas": {"a": bad}}, "#/dependentSchemas/a"),
        ({"patternProperties": {"^a": bad}}, "#/patternProperties/^a"),
        ({"if": {}, "then": {"else": bad}}, "#/then/else"),
        ({"prefixItems": [{}, bad]}, "#/prefixItems/1"),
        ({"propertyNames": bad}, "#/propertyNames"),
        ({"contains": bad}, "#/contains"),
        ({"$schema": D7, "dependencies": {"a": bad}}, "#/dependencies/a"),
        ({"properties": {"a~b/c": bad}}, "#/properties/a~0b~1c"),
    ):
        found = problem(schema)
        assert found is not None and found.location == where, (schema, found)


def test_deep_and_wide_schemas_are_walked_without_recursion() -> None:
    deep: dict[str, Any] = {"type": "strin"}
    for _ in range(3000):  # jsonschema's own check exhausts the recursion limit at ~60 levels
        deep = {"not": deep}
    found = problem(deep)
    assert found is not None and found.location.count("/not") == 3000
    wide = {"type": "object", "required": [f"k{i}" for i in range(100_000)]}
    assert problem(wide) is None
    assert problem({"$schema": D4, "enum": [{"a": i} for i in range(20_000)]}) is None


@pytest.mark.parametrize("mode", [COMPLETE, STRICT])
def test_compile_refuses_an_invalid_schema_naming_the_field(tok: Tokenizer, mode: int) -> None:
    opts = common_pb2.JsonOptions(schema_mode=mode)
    for constraint, field in (
        (
            common_pb2.Constraint(
                json_schema='{"type": "string", "format": ["date"]}', json_options=opts
            ),
            "constraint.json_schema",
        ),
        (
            common_pb2.Constraint(
                structural_tags=common_pb2.StructuralTags(
                    tags=[
                        common_pb2.StructuralTag(
                            begin="<f>", json_schema='{"properties": {"a": 5}}', end="</f>"
                        )
                    ]
                ),
                json_options=opts,
            ),
            "constraint.structural_tags.tags[0].json_schema",
        ),
    ):
        with pytest.raises(RpcError) as info:
            compile_constraint(constraint, tok, ParserLimits())
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.reason == "INVALID_CONSTRAINT"
        assert info.value.violations[0][0] == field
        assert "not a valid JSON Schema (draft 2020-12)" in info.value.message


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ('{"maximum": NaN}', "NaN is not a JSON number"),
        ('{"maximum": -Infinity}', "-Infinity is not a JSON number"),
        ('{"maximum": 1e999}', "1e999 is out of range"),
        ('{"maximum": ' + "9" * 400 + "}", "(400 characters) is out of range"),
        ('{"maximum": ' + "9" * 5000 + "}", "(5000 characters) is out of range"),
    ],
)
def test_numbers_the_grammar_compiler_cannot_read_are_refused(
    tok: Tokenizer, text: str, detail: str
) -> None:
    with pytest.raises(RpcError) as info:
        compile_constraint(common_pb2.Constraint(json_schema=text), tok, ParserLimits())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == "constraint.json_schema"
    assert detail in info.value.message


@pytest.fixture
def listener() -> Iterator[tuple[str, list[str]]]:
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/s.json", hits
    finally:
        server.shutdown()
        server.server_close()


def test_the_offline_registry_never_retrieves(listener: tuple[str, list[str]]) -> None:
    url, hits = listener
    schema = {"properties": {"a": {"$ref": url}}}
    assert problem(schema) is None  # a reference is a string to the metaschema: not followed
    validator = jsonschema.Draft202012Validator(schema, registry=OFFLINE)
    with pytest.raises(referencing.exceptions.Unresolvable):
        validator.is_valid({"a": 1})
    meta = OFFLINE.resolver().lookup("https://json-schema.org/draft/2020-12/schema")
    assert meta.contents["$id"] == "https://json-schema.org/draft/2020-12/schema"
    assert hits == []
