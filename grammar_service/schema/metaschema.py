"""Is a JSON schema a valid schema of its draft? Each subschema checked against the metaschema.

jsonschema's `check_schema` validates the whole document against the metaschema in one recursive
pass (draft 2020-12's through `$dynamicRef`s): about 300 µs per subschema and a chain of Python
frames per level, so a 1 MiB schema takes a minute and one 60 levels deep exhausts the recursion
limit. The same verdicts come cheaper here. Each draft's metaschema is flattened once into one
schema per keyword, for that keyword's value, in which a subschema is only "an object or a
boolean" (`_Draft`); the schema is then walked with an explicit stack, and each keyword of each
subschema is validated on its own (values seen before are remembered). The time is linear in
the schema, whose size and depth `bounds` has limited before; nothing recurses, `uniqueItems` is
decided by hashing (jsonschema compares unhashable items pairwise), and no reference is resolved
beyond the metaschemas' own ones, offline (`registry.OFFLINE`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urldefrag

import jsonschema
from jsonschema.exceptions import ValidationError, best_match
from jsonschema.protocols import Validator
from referencing._core import Resolver

from grammar_service.schema.keywords import MANY, MAP, canon, child, children
from grammar_service.schema.registry import OFFLINE

_SUB: Any = object()  # in a flattened schema: "a subschema goes here"
# Keywords of a metaschema that say nothing about the keyword values they sit in.
_SKIP = frozenset(
    {
        "$id",
        "id",
        "$schema",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "$vocabulary",
        "$comment",
        "$defs",
        "definitions",
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
    }
)
_ITEMS_TYPE = "maskwire:itemsType"  # `items: {"type": ...}`, checked without a descent per item
_PYTHON_TYPES = {"string": str, "object": dict, "array": list, "boolean": bool}
_NAMED = frozenset({"properties", "patternProperties", "dependentSchemas", "dependencies"})
_MEMO_LIMIT = 4096
DRAFT_NAMES = {
    jsonschema.Draft3Validator: "draft 3",
    jsonschema.Draft4Validator: "draft 4",
    jsonschema.Draft6Validator: "draft 6",
    jsonschema.Draft7Validator: "draft 7",
    jsonschema.Draft201909Validator: "draft 2019-09",
    jsonschema.Draft202012Validator: "draft 2020-12",
}


@dataclass(frozen=True)
class Problem:
    """Why a schema is not a valid schema: the keyword, where, and the metaschema's verdict."""

    keyword: str
    location: str  # JSON pointer of the subschema
    message: str
    draft: str

    def __str__(self) -> str:
        where = f"'{self.keyword}' at {self.location}" if self.keyword else self.location
        return f"not a valid JSON Schema ({self.draft}): {where}: {self.message}"


def problem(schema: dict[str, Any]) -> Problem | None:
    """The first reason `schema` is not a valid schema of its draft (`$schema`, else 2020-12)."""
    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        return Problem("$schema", "#", f"{declared!r} is not of type 'string'", "draft 2020-12")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    draft = _draft(cls)
    # (keyword, path as pointer parts, subschema): pointers are built only for a problem.
    stack: list[tuple[str, tuple[str | int, ...], Any]] = [("", (), schema)]
    while stack:
        keyword, path, node = stack.pop()
        if not isinstance(node, dict):
            if isinstance(node, bool) and draft.booleans:
                continue
            message = f"{node!r} is not a schema ({draft.expected})"
            return Problem(keyword, child("#", *path), message, draft.name)
        if not node:
            continue
        found = draft.node_problem(node)
        if found is not None:
            key, message = found
            return Problem(key, child("#", *path), message, draft.name)
        for key, name, sub in children(node):
            if key in draft.keywords:
                stack.append((key, (*path, key) if name is None else (*path, key, name), sub))
    return None


class _Draft:
    """One draft's metaschema as a validator per keyword (see the module docstring)."""

    def __init__(self, cls: Any) -> None:
        meta = cls.META_SCHEMA
        self.name = DRAFT_NAMES.get(cls, "draft 2020-12")
        kinds = meta.get("type", "object")
        self.booleans = "boolean" in (kinds if isinstance(kinds, list) else [kinds])
        self.expected = "an object or a boolean" if self.booleans else "an object"
        subschema = {"type": ["object", "boolean"] if self.booleans else "object"}
        checker = jsonschema.validators.extend(
            cls, {"uniqueItems": _unique_items, _ITEMS_TYPE: _items_type}
        )
        resolver = OFFLINE.resolver(base_uri=urldefrag(meta.get("$id", meta.get("id", ""))).url)
        self.keywords: dict[str, Validator] = {}
        rest: dict[str, Any] = {}
        for part, at in _parts(meta, resolver):
            for key, value in part.get("properties", {}).items():
                flat = _flatten(value, at)
                if key in MAP or key in MANY:
                    flat = _children_unchecked(flat)  # the walk checks each child itself
                self.keywords[key] = checker(_typed_items(_fill(flat, subschema)), registry=OFFLINE)
            for key, value in part.items():
                if key not in _SKIP and key not in ("properties", "allOf", "type"):
                    rest[key] = _fill(_flatten(value, at), subschema)
        self.rest: Validator | None = checker(rest, registry=OFFLINE) if rest else None
        self._memo: dict[tuple[str, type, Any], str | None] = {}

    def node_problem(self, node: dict[str, Any]) -> tuple[str, str] | None:
        """(keyword, the metaschema's verdict) for the first keyword of `node` it refuses."""
        for key, value in node.items():
            validator = self.keywords.get(key)
            if validator is None:
                continue
            memo_key = (key, type(value), value) if _scalar(value) else None
            if memo_key is not None and memo_key in self._memo:
                message = self._memo[memo_key]
                if message is not None:
                    return key, message
                continue
            err = best_match(validator.iter_errors(value))
            if memo_key is not None:
                if len(self._memo) >= _MEMO_LIMIT:
                    self._memo.clear()
                self._memo[memo_key] = None if err is None else _message(err)
            if err is not None:
                return key, _message(err)
        if self.rest is not None:
            err = best_match(self.rest.iter_errors(node))
            if err is not None:
                return str(err.validator), err.message
        return None


@functools.cache
def _draft(cls: Any) -> _Draft:
    return _Draft(cls)


def _parts(meta: dict[str, Any], resolver: Resolver[Any]) -> Iterator[tuple[Any, Resolver[Any]]]:
    """The metaschema and, for 2019-09 and later, each vocabulary's metaschema it includes."""
    yield meta, resolver
    for item in meta.get("allOf", []):
        if isinstance(item, dict) and isinstance(item.get("$ref"), str):
            resolved = resolver.lookup(item["$ref"])
            yield resolved.contents, resolved.resolver


def _is_metaschema(node: Any) -> bool:
    """A draft's metaschema or a vocabulary's: references to it mean "a subschema"."""
    if not isinstance(node, dict):
        return False
    own = node.get("$id", node.get("id"))
    return (
        node.get("$dynamicAnchor") == "meta"
        or node.get("$recursiveAnchor") is True
        or (own is not None and own == node.get("$schema"))
    )


def _flatten(node: Any, resolver: Resolver[Any]) -> Any:
    """A metaschema fragment with its references inlined and references to a metaschema (or a
    dynamic / recursive one) replaced by `_SUB`; annotations and identifiers dropped."""
    if isinstance(node, list):
        return [_flatten(x, resolver) for x in node]
    if not isinstance(node, dict):
        return node
    if "$dynamicRef" in node or "$recursiveRef" in node:
        return _SUB
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SKIP or key == "$ref":
            continue
        if key in _NAMED and isinstance(value, dict):
            out[key] = {name: _flatten(v, resolver) for name, v in value.items()}
        else:
            out[key] = _flatten(value, resolver)
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return out
    resolved = resolver.lookup(ref)
    target = (
        _SUB
        if _is_metaschema(resolved.contents)
        else _flatten(resolved.contents, resolved.resolver)
    )
    return {"allOf": [target, out]} if out else target


def _children_unchecked(node: Any) -> Any:
    """`items` / `additionalProperties` that are subschemas become `true`: the walk checks each
    array item and map member of these keywords itself (jsonschema would descend into each)."""
    if isinstance(node, list):
        return [_children_unchecked(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {
        k: True if k in ("items", "additionalProperties") and v is _SUB else _children_unchecked(v)
        for k, v in node.items()
    }


def _fill(node: Any, subschema: dict[str, Any]) -> Any:
    if node is _SUB:
        return subschema
    if isinstance(node, list):
        return [_fill(x, subschema) for x in node]
    if isinstance(node, dict):
        return {k: _fill(v, subschema) for k, v in node.items()}
    return node


def _message(err: ValidationError) -> str:
    """The metaschema's verdict, saying where inside the keyword's value it applies."""
    inside = "".join(f"[{p!r}]" for p in err.absolute_path)
    return f"{err.message} (at {inside})" if inside else err.message


def _typed_items(node: Any) -> Any:
    """`items` that only name a type become `_ITEMS_TYPE` (a `required` of 100,000 names is
    checked in milliseconds instead of seconds)."""
    if isinstance(node, list):
        return [_typed_items(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _typed_items(v) for k, v in node.items()}
    items = out.get("items")
    if isinstance(items, dict) and set(items) == {"type"}:
        out[_ITEMS_TYPE] = out.pop("items")["type"]
    return out


def _items_type(validator: Any, kinds: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "array"):
        return
    names = [kinds] if isinstance(kinds, str) else kinds
    plain = {_PYTHON_TYPES.get(k) for k in names}
    if None not in plain and all(type(item) in plain for item in instance):
        return
    for i, item in enumerate(instance):
        if not any(validator.is_type(item, k) for k in names):
            yield ValidationError(
                f"{item!r} is not of type {', '.join(repr(k) for k in names)}", path=[i]
            )
            return


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """`uniqueItems` in linear time (JSON Schema equality through `canon`)."""
    if unique and validator.is_type(instance, "array"):
        if all(type(item) is str for item in instance):  # names (`required`): no canon needed
            if len(set(instance)) < len(instance):
                yield ValidationError(f"{instance!r} has non-unique elements")
            return
        seen: set[Any] = set()
        for item in instance:
            key = canon(item)
            if key in seen:
                yield ValidationError(f"{instance!r} has non-unique elements")
                return
            seen.add(key)
