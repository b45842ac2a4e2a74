from __future__ import annotations

import copy
from typing import Any

import jsonschema

from grammar_service.json_options import forbid_additional_properties


def forbid(schema: dict[str, Any]) -> dict[str, Any]:
    return forbid_additional_properties(copy.deepcopy(schema))


def test_plain_objects_get_additional_properties_false() -> None:
    s = forbid(
        {
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            },
        }
    )
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["b"]["items"]["additionalProperties"] is False


def test_explicit_choices_are_kept() -> None:
    s = forbid({"properties": {"a": {}}, "additionalProperties": {"type": "string"}})
    assert s["additionalProperties"] == {"type": "string"}
    s = forbid({"properties": {"a": {}}, "unevaluatedProperties": True})
    assert "additionalProperties" not in s
    s = forbid({"properties": {"a": {}}, "patternProperties": {"^x": {}}})
    assert "additionalProperties" not in s


def test_intersections_stay_satisfiable() -> None:
    schema = {
        "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
        "allOf": [
            {"$ref": "#/$defs/base"},
            {"properties": {"name": {"type": "string"}}},
        ],
        "required": ["id", "name"],
    }
    s = forbid(schema)
    instance = {"id": 1, "name": "x"}
    jsonschema.validate(instance, schema)
    jsonschema.validate(instance, s)  # still satisfiable by the same instance
    assert "additionalProperties" not in s["$defs"]["base"]
    assert "additionalProperties" not in s["allOf"][1]
    sibling = forbid(
        {"properties": {"a": {}}, "$ref": "#/$defs/b", "$defs": {"b": {"properties": {"b": {}}}}}
    )
    assert "additionalProperties" not in sibling
    assert "additionalProperties" not in sibling["$defs"]["b"]


def test_any_of_branches_are_independent_and_not_is_untouched() -> None:
    s = forbid(
        {
            "anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
            "not": {"properties": {"c": {}}},
        }
    )
    assert all(b["additionalProperties"] is False for b in s["anyOf"])
    assert "additionalProperties" not in s["not"]
