"""`response_format` / `structured_outputs` / `guided_*` -> one `Constraint` proto.

Only shape errors are caught here (two constraints at once, a schema that is not an object or a
boolean, numbers JSON cannot carry, an empty choice); whether a schema or grammar compiles is the grammar service's call, and its
field-level reasons come back through the worker as a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway import schemas
from gateway.errors import bad_request
from gateway.input_check import check_numbers, parse_json_text
from gateway.limits import DEFAULT_MAX_JSON_DEPTH
from maskwire.v1 import common_pb2


@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint and the request field it came from (errors point at that field)."""

    constraint: common_pb2.Constraint
    param: str


def json_options(
    *, strict: bool = False, whitespace_flexible: bool | None = None
) -> common_pb2.JsonOptions:
    """Compact JSON by default (small models wander with free whitespace; see NOTES.md)."""
    opts = common_pb2.JsonOptions(whitespace_flexible=bool(whitespace_flexible))
    if strict:
        opts.additional_properties = common_pb2.ADDITIONAL_PROPERTIES_FORBID
    return opts


def with_schema_mode(constraint: common_pb2.Constraint, mode: str | None) -> None:
    """Apply the request's `schema_mode` extension (JSON schemas only; unset: the service's)."""
    if mode is not None and constraint.WhichOneof("kind") in ("json_schema", "structural_tags"):
        constraint.json_options.schema_mode = common_pb2.SchemaMode.Value(
            f"SCHEMA_MODE_{mode.upper()}"
        )


def schema_text(schema: Any, param: str, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> str:
    """Serialize a JSON Schema given as an object (or as JSON text) after a shape check."""
    if isinstance(schema, str):
        try:
            schema = parse_json_text(schema, param, max_depth)
        except json.JSONDecodeError as e:
            raise bad_request(f"the schema is not valid JSON: {e}", param) from e
    else:
        check_numbers(schema, param, max_depth)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_request(
            f"a JSON Schema must be an object or a boolean, got {_json_type(schema)}", param
        )
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "a string", list: "an array", int: "a number", float: "a number"}[type(value)]


def is_gbnf(grammar: str) -> bool:
    """GBNF rules use `::=`; llguidance's Lark dialect uses `:`."""
    return "::=" in grammar


def _grammar(grammar: str, param: str) -> common_pb2.Constraint:
    if not grammar.strip():
        raise bad_request("the grammar is empty", param)
    if is_gbnf(grammar):
        return common_pb2.Constraint(gbnf=grammar)
    return common_pb2.Constraint(lark=grammar)


def _choice(choices: list[str], param: str) -> common_pb2.Constraint:
    if not choices:
        raise bad_request("`choice` needs at least one alternative", param)
    if any(c == "" for c in choices):
        raise bad_request("`choice` alternatives must not be empty", param)
    return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=choices))


def _from_structured(so: schemas.StructuredOutputs, max_depth: int) -> ConstraintSpec:
    param = "structured_outputs"
    given = [
        k
        for k, v in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if v is not None
    ]
    if len(given) != 1:
        raise bad_request(
            "`structured_outputs` needs exactly one of json, regex, choice, grammar, json_object"
            f" (got {', '.join(given) or 'none'})",
            param,
        )
    where = f"{param}.{given[0]}"
    opts = json_options(whitespace_flexible=so.whitespace_flexible)
    if so.json_ is not None:
        c = common_pb2.Constraint(
            json_schema=schema_text(so.json_, where, max_depth), json_options=opts
        )
    elif so.json_object:
        c = common_pb2.Constraint(json_object=True, json_options=opts)
    elif so.regex is not None:
        c = _regex(so.regex, where)
    elif so.choice is not None:
        c = _choice(so.choice, where)
    else:
        assert so.grammar is not None
        c = _grammar(so.grammar, where)
    return ConstraintSpec(c, where)


def _regex(regex: str, param: str) -> common_pb2.Constraint:
    if not regex:
        raise bad_request("the regex is empty", param)
    return common_pb2.Constraint(regex=regex)


def _from_response_format(rf: Any, max_depth: int) -> ConstraintSpec | None:
    if isinstance(rf, schemas.ResponseFormatText):
        return None
    if isinstance(rf, schemas.ResponseFormatJsonObject):
        return ConstraintSpec(
            common_pb2.Constraint(json_object=True, json_options=json_options()),
            "response_format",
        )
    assert isinstance(rf, schemas.ResponseFormatJsonSchema)
    spec = rf.json_schema
    param = "response_format.json_schema.schema"
    if spec.schema_ is None:
        raise bad_request("`response_format.json_schema` needs a `schema`", param)
    return ConstraintSpec(
        common_pb2.Constraint(
            json_schema=schema_text(spec.schema_, param, max_depth),
            json_options=json_options(strict=bool(spec.strict)),
        ),
        param,
    )


def _from_guided(req: schemas._SamplingFields, max_depth: int) -> ConstraintSpec | None:
    """vLLM's older top-level `guided_*` fields."""
    given = [
        k
        for k, v in (
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice),
            ("guided_grammar", req.guided_grammar),
        )
        if v is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give only one constraint (got {', '.join(given)})", given[1])
    name = given[0]
    if req.guided_json is not None:
        c = common_pb2.Constraint(
            json_schema=schema_text(req.guided_json, name, max_depth),
            json_options=json_options(),
        )
    elif req.guided_regex is not None:
        c = _regex(req.guided_regex, name)
    elif req.guided_choice is not None:
        c = _choice(req.guided_choice, name)
    else:
        assert req.guided_grammar is not None
        c = _grammar(req.guided_grammar, name)
    return ConstraintSpec(c, name)


def from_request(
    req: schemas._SamplingFields, max_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> ConstraintSpec | None:
    """The request's output constraint, or None for free text. At most one source may be set.
    `max_depth` bounds the nesting of a schema sent as JSON text."""
    found: list[ConstraintSpec] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format, max_depth)
        if spec is not None:
            found.append(spec)
    if req.structured_outputs is not None:
        found.append(_from_structured(req.structured_outputs, max_depth))
    guided = _from_guided(req, max_depth)
    if guided is not None:
        found.append(guided)
    if len(found) > 1:
        raise bad_request(
            "give only one of response_format, structured_outputs and guided_* "
            f"(got {', '.join(s.param for s in found)})",
            found[1].param,
        )
    return found[0] if found else None
