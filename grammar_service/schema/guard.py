"""What the output check will run, checked before a schema is accepted.

The output check validates every output against the schema as sent, including the parts the
grammar never sees (under `not`, `if`, `$dynamicRef`). So before it exists:

* every reference (`$ref`, `$dynamicRef`, `$recursiveRef`) must resolve inside the schema as sent
  (its JSON pointers, anchors and `$id`s) or to a draft's metaschema, which jsonschema bundles.
  `registry.OFFLINE` never retrieves anything: no URL is fetched and no file opened, at compile
  time or while validating;
* every `pattern` and `patternProperties` key must run in RE2 (`patterns`), so no output can make
  a match backtrack.

A schema that fails either is refused with INVALID_ARGUMENT naming the keyword, where it is and
why, before anything validates with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import referencing.jsonschema
from referencing.exceptions import Unresolvable

from grammar_service.schema.keywords import subschemas
from grammar_service.schema.patterns import PatternError, compiled
from grammar_service.schema.registry import OFFLINE
from maskwire.rpc import RpcError

_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


def _refused(field: str, keyword: str, where: str, why: str, reason: str) -> RpcError:
    detail = f"'{keyword}' at {where}: {why}"
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT, f"invalid {field}: {detail}", [(field, detail)], reason
    )


@dataclass(frozen=True)
class _Node:
    ptr: str
    schema: dict[str, Any]
    spec: Any  # its draft (`referencing.Specification`)
    parent: int  # index of the enclosing subschema (-1: the root)


def check(schema: dict[str, Any], field: str) -> None:
    """Raise `RpcError(INVALID_ARGUMENT)` when the output check could not run `schema` safely
    (see the module docstring). Iterative: any schema the bounds admit is walked."""
    nodes = _subschemas(schema, field)
    for node in nodes:
        _check_patterns(node.schema, node.ptr, field)
    _check_references(nodes, field)


def _subschemas(schema: dict[str, Any], field: str) -> list[_Node]:
    """Every object subschema, parents before children; refused when an identifier (`$id`) is
    not a string."""
    out: list[_Node] = []
    stack = [_Node("#", schema, _dialect(schema, referencing.jsonschema.DRAFT202012), -1)]
    while stack:
        node = stack.pop()
        ident = node.spec.id_of(node.schema)
        if ident is not None and not isinstance(ident, str):
            why = "an identifier must be a string"
            raise _refused(field, "$id", node.ptr, why, "INVALID_CONSTRAINT")
        out.append(node)
        for _, ptr, sub in subschemas(node.schema, node.ptr):
            if isinstance(sub, dict):
                stack.append(_Node(ptr, sub, _dialect(sub, node.spec), len(out) - 1))
    return out


def _check_references(nodes: list[_Node], field: str) -> None:
    """Every reference resolves in `REGISTRY` plus the schema, each against its base URI."""
    root = nodes[0].spec.create_resource(nodes[0].schema)
    base = root.id() or ""
    registry = OFFLINE.with_resource(base, root).crawl()
    resolvers: list[Any] = []
    for node in nodes:
        outer = resolvers[node.parent] if node.parent >= 0 else registry.resolver(base_uri=base)
        resolver = outer.in_subresource(node.spec.create_resource(node.schema))
        resolvers.append(resolver)
        for keyword in _REFERENCES:
            ref = node.schema.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except (Unresolvable, ValueError):
                why = (
                    f"{ref!r} is not in the schema: references resolve only to the schema "
                    "itself (its pointers, anchors and $ids), never to a file or a URL, which "
                    "are never fetched"
                )
                raise _refused(field, keyword, node.ptr, why, "INVALID_CONSTRAINT") from None


def _dialect(node: dict[str, Any], default: Any) -> Any:
    """The draft a (sub)schema is written in: its `$schema`, else the enclosing one's."""
    dialect = node.get("$schema")
    if not isinstance(dialect, str):
        return default
    return referencing.jsonschema.specification_with(dialect, default=default)


def _check_patterns(node: dict[str, Any], ptr: str, field: str) -> None:
    found: list[tuple[str, Any]] = []
    if "pattern" in node:
        found.append(("pattern", node["pattern"]))
    if isinstance(node.get("patternProperties"), dict):
        found.extend(("patternProperties", p) for p in node["patternProperties"])
    for keyword, pattern in found:
        if not isinstance(pattern, str):
            raise _refused(field, keyword, ptr, "a pattern must be a string", "INVALID_CONSTRAINT")
        try:
            compiled(pattern)
        except PatternError as e:
            reason = "UNSUPPORTED_CONSTRAINT" if e.unsupported else "INVALID_CONSTRAINT"
            why = f"{e.reason}; the output check matches patterns with RE2: {pattern!r}"
            raise _refused(field, keyword, ptr, why, reason) from None
