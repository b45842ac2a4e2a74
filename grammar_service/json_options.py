"""JSON layout defaults and the `AdditionalProperties.FORBID` schema rewrite.

FORBID adds `additionalProperties: false` to object schemas that list `properties` and say nothing
about additional, unevaluated or pattern properties, as OpenAI's strict mode assumes. It must never
turn a satisfiable schema into an unsatisfiable one, so it leaves alone every schema that is
*intersected* with another one, because there a property listed by the sibling would become
forbidden:

* members of `allOf`, and `if` / `then` / `else` / `dependentSchemas` subschemas (they apply
  together with their parent);
* a schema that itself has `allOf`, `$ref`, `$dynamicRef`, `if`, `dependentSchemas`, `anyOf` or
  `oneOf` beside its `properties` (its properties are merged with those of the applicators);
* definitions reached by a `$ref` from any of the places above;
* everything under `not` (forbidding there would *widen* what the outer schema accepts).

`anyOf` / `oneOf` members and `items` / `properties` values are independent schemas and do get it.
"""

from __future__ import annotations

from typing import Any

DEFAULT_ITEM_SEPARATOR = ", "
DEFAULT_KEY_SEPARATOR = ": "

# Keywords whose value is one subschema / a list of them / a name -> subschema map.
_ONE = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
)
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# Subschemas applied together with their parent: intersections, left untouched.
_INTERSECTED_MANY = ("allOf",)
_INTERSECTED_ONE = ("if", "then", "else")
_INTERSECTED_MAP = ("dependentSchemas",)
_MERGING_SIBLINGS = ("allOf", "$ref", "$dynamicRef", "if", "dependentSchemas", "anyOf", "oneOf")
_ALREADY_SAYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def forbid_additional_properties(
    schema: dict[str, Any], closed: list[str] | None = None
) -> dict[str, Any]:
    """Rewrite `schema` in place (pass a copy) and return it; `closed` collects the JSON
    pointers of the objects that got `additionalProperties: false`."""
    protected: set[str] = set()
    _collect_protected_refs(schema, protected, intersected=False)
    _rewrite(schema, schema, protected, path="#", intersected=False, closed=closed)
    return schema


def strict_contradiction(schema: dict[str, Any], closed: list[str]) -> tuple[str, str] | None:
    """(pointer, name) of a property an object closed by FORBID requires but does not list: no
    instance can have it, so OpenAI's strict mode makes the schema unsatisfiable there."""
    for path in closed:
        node = _at(schema, path)
        required = node.get("required") if isinstance(node, dict) else None
        if not isinstance(required, list):
            continue
        props = node.get("properties", {})
        for name in required:
            if isinstance(name, str) and name not in props:
                return path, name
    return None


def _at(root: Any, path: str) -> Any:
    node = root
    for part in path.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _local_ref(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref")
    return ref if isinstance(ref, str) and ref.startswith("#") else None


def _collect_protected_refs(node: Any, out: set[str], *, intersected: bool) -> None:
    """Refs that land in an intersection: their targets must not be rewritten."""
    if isinstance(node, list):
        for item in node:
            _collect_protected_refs(item, out, intersected=intersected)
        return
    if not isinstance(node, dict):
        return
    ref = _local_ref(node)
    if ref is not None and (
        intersected
        or any(k in node for k in _MERGING_SIBLINGS if k != "$ref")
        or "properties" in node
    ):
        out.add(ref)
    for key, value in node.items():
        inner = key in _INTERSECTED_MANY or key in _INTERSECTED_ONE or key in _INTERSECTED_MAP
        if key == "not":
            inner = True
        if key in _INTERSECTED_MAP and isinstance(value, dict):
            for sub in value.values():
                _collect_protected_refs(sub, out, intersected=True)
            continue
        _collect_protected_refs(value, out, intersected=inner)


def _rewrite(
    node: Any,
    root: dict[str, Any],
    protected: set[str],
    *,
    path: str,
    intersected: bool,
    closed: list[str] | None,
) -> None:
    if not isinstance(node, dict):
        return
    if (
        not intersected
        and path not in protected
        and isinstance(node.get("properties"), dict)
        and not any(k in node for k in _ALREADY_SAYS)
        and not any(k in node for k in _MERGING_SIBLINGS)
    ):
        node["additionalProperties"] = False
        if closed is not None:
            closed.append(path)
    for key, value in list(node.items()):
        if key == "not" or key in _INTERSECTED_ONE:
            continue  # see module docstring
        if key in _INTERSECTED_MANY or key in _INTERSECTED_MAP:
            continue
        if key in _ONE:
            _rewrite(value, root, protected, path=f"{path}/{key}", intersected=False, closed=closed)
        elif key in _MANY and isinstance(value, list):
            for i, sub in enumerate(value):
                _rewrite(
                    sub, root, protected, path=f"{path}/{key}/{i}", intersected=False, closed=closed
                )
        elif key in _MAP and isinstance(value, dict):
            for name, sub in value.items():
                _rewrite(
                    sub,
                    root,
                    protected,
                    path=f"{path}/{key}/{_escape(name)}",
                    intersected=False,
                    closed=closed,
                )


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
