"""JSON Schema keyword tables and JSON-pointer helpers shared by the schema layer's modules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords whose value is one subschema / a list of subschemas / a name -> subschema map.
ONE = frozenset(
    {
        "items",  # a list in drafts before 2020-12 (handled as MANY then)
        "additionalItems",
        "additionalProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
MANY = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})

# Keywords that never constrain an instance (the spec calls them annotations or identifiers).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
        "$schema",
        "$id",
        "$anchor",
        "$vocabulary",
        "x-guidance",
    }
)
STRUCTURAL = frozenset({"$defs", "definitions"})

# Assertion and applicator keywords llguidance enforces as written (a few with limits that the
# layer checks: `format` for the names it knows, min/maxProperties when every listed property is
# required, `oneOf` only with coerce_one_of).
GRAMMAR = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "allOf",
        "oneOf",
        "$ref",
        "minProperties",
        "maxProperties",
    }
)

# Keywords whose value must be a non-negative integer (llguidance refuses `2.0`).
COUNTS = frozenset(
    {
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minProperties",
        "maxProperties",
        "minContains",
        "maxContains",
    }
)

KINDS = ("null", "boolean", "object", "array", "string", "number")


def escape(name: str) -> str:
    """A name as one JSON-pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


def child(pointer: str, *parts: str | int) -> str:
    return pointer + "".join(f"/{escape(str(p))}" for p in parts)


def resolve(root: Any, pointer: str) -> Any:
    """The value a local JSON pointer (`#`, `#/a/b`) names, or None (anchors and other
    documents are not pointers)."""
    if pointer != "#" and not pointer.startswith("#/"):
        return None
    node = root
    for part in pointer[2:].split("/") if pointer != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def subschemas(node: dict[str, Any], pointer: str) -> Iterator[tuple[str, str, Any]]:
    """(keyword, pointer, subschema) for every subschema directly inside `node`."""
    for key, name, sub in children(node):
        yield key, child(pointer, key) if name is None else child(pointer, key, name), sub


def children(node: dict[str, Any]) -> Iterator[tuple[str, str | int | None, Any]]:
    """`subschemas` without pointers: (keyword, member name or item index or None, subschema)."""
    for key, value in node.items():
        if key in MAP and isinstance(value, dict):
            for name, sub in value.items():
                yield key, name, sub
        elif key in MANY and isinstance(value, list):
            for i, sub in enumerate(value):
                yield key, i, sub
        elif key in ONE and isinstance(value, dict | bool):
            yield key, None, value
        elif key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict | bool):
                    yield key, name, sub


def kinds_of(node: Any) -> frozenset[str] | None:
    """The kinds of JSON value (`KINDS`: integers are numbers) a schema's own `type`, `const`
    and `enum` allow; None when they say nothing."""
    if node is False:
        return frozenset()
    if not isinstance(node, dict):
        return None
    found: frozenset[str] | None = None
    t = node.get("type")
    if isinstance(t, str):
        t = [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        found = frozenset(_kind(x) for x in t)
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list):
        vk = frozenset(_kind(value_type(v)) for v in values)
        found = vk if found is None else found & vk
    return found


def _kind(type_name: str) -> str:
    return "number" if type_name == "integer" else type_name


def value_type(value: Any) -> str:
    """The JSON type name of a Python value from `json.loads` (whole numbers are `integer`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def canon(value: Any) -> Any:
    """A hashable form of a JSON value under JSON Schema's equality: 1 == 1.0, true != 1,
    objects compare without order."""
    if isinstance(value, bool) or value is None:
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(canon(v) for v in value))
    return ("o", frozenset((k, canon(v)) for k, v in value.items()))
