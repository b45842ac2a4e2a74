"""JSON schemas that several suites constrain requests with (plain data: the XLA stage's
environment imports it too)."""

from __future__ import annotations

from typing import Any

# A person with a bounded name and age: short outputs with a string, an integer and closed keys.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
