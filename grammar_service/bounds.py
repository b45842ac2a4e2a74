"""Structural bounds on a constraint, checked before anything compiles it.

llguidance recurses once per `$ref` hop of a JSON schema and once per rule of a Lark chain; a chain a
few thousand long overflows the native stack and kills the process (SIGSEGV), which no exception
handler can catch. These checks measure what the compiler would recurse over, with explicit stacks
(never Python recursion), and refuse a constraint past a bound with `INVALID_ARGUMENT` naming the
bound and its flag. They run in microseconds on real schemas; the compile sandbox
(`grammar_service.sandbox`) is the second line for whatever they do not foresee.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import grpc

from grammar_service.config import ConstraintBounds
from maskwire.rpc import RpcError


def too_complex(field: str, what: str, limit: int, flag: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid {field}: {what}; this service accepts at most {limit} ({flag})",
        [(field, f"{what} (limit {limit}, {flag})")],
        reason="CONSTRAINT_TOO_COMPLEX",
    )


# ---------------------------------------------------------------------------------- JSON schema
def _children(node: Any) -> Iterator[Any]:
    """The containers directly inside a JSON value."""
    values = node.values() if isinstance(node, dict) else node
    for v in values:
        if isinstance(v, dict | list):
            yield v


def _resolve_local_ref(root: Any, ref: str) -> Any | None:
    """The node a local JSON pointer `#/a/b` names (None: not local, or not found)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | list) else None


def schema_shape(root: Any) -> tuple[int, int]:
    """(depth, nodes): the longest nesting chain of containers where a local `$ref` counts as
    nesting its target (cycles are cut: recursion is fine, only chains are deep), and the number
    of containers. Iterative, so any input is measured without exhausting Python's stack."""
    if not isinstance(root, dict | list):
        return 0, 0
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    nodes = 0
    # Post-order DFS: (node, expanded?). A node's depth is 1 + its deepest child.
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            on_path.discard(key)
            best = 0
            for child in _edges(root, node):
                best = max(best, depth.get(id(child), 0))
            depth[key] = best + 1
            continue
        if key in depth or key in on_path:
            continue
        nodes += 1
        on_path.add(key)
        stack.append((node, True))
        for child in _edges(root, node):
            ck = id(child)
            if ck not in depth and ck not in on_path:
                stack.append((child, False))
    return depth[id(root)], nodes


def _edges(root: Any, node: Any) -> Iterator[Any]:
    yield from _children(node)
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve_local_ref(root, ref)
            if target is not None and target is not node:
                yield target


def check_schema(schema: Any, field: str, bounds: ConstraintBounds) -> None:
    depth, nodes = schema_shape(schema)
    if nodes > bounds.max_schema_nodes:
        raise too_complex(
            field, f"the schema has {nodes} objects", bounds.max_schema_nodes, "--max-schema-nodes"
        )
    if depth > bounds.max_schema_depth:
        raise too_complex(
            field,
            f"the schema nests {depth} levels deep (counting $ref hops)",
            bounds.max_schema_depth,
            "--max-schema-depth",
        )


# ---------------------------------------------------------------------------------- Lark
# A rule or terminal definition at the start of a line: `?name:`, `!name.2:`, `NAME:`.
_HEADER = re.compile(r"^[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:", re.MULTILINE)
# What can hold identifier-like text that is not a reference: strings, regexes, `%json {...}`
# bodies (skipped by brace counting below), special tokens `<...>`, comments.
_SKIP = re.compile(
    r'"(?:[^"\\\n]|\\.)*"'  # "string"
    r"|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*"  # /regex/flags
    r"|<\[[^\]\n]*\]>|<\|[^|\n]*\|>"  # special tokens
    r"|//[^\n]*"  # comment
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def split_json_blocks(text: str) -> tuple[str, list[str]]:
    """The grammar without its `%json { ... }` bodies, and those bodies (JSON schemas inside a
    Lark grammar: not rule references, but measured as schemas)."""
    out: list[str] = []
    blocks: list[str] = []
    i = 0
    while True:
        j = text.find("%json", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out), blocks
        out.append(text[i:j])
        k = text.find("{", j)
        if k < 0:
            return "".join(out), blocks
        level, in_str, esc, m = 0, False, False, k
        for m in range(k, len(text)):
            c = text[m]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "{":
                level += 1
            elif c == "}":
                level -= 1
                if level == 0:
                    break
        blocks.append(text[k : m + 1])
        i = m + 1


def grammar_shape(lark: str) -> tuple[int, int]:
    """(depth, rules) of a Lark grammar: the longest chain of references between its rules and
    terminals (cycles cut) and how many it defines."""
    text = _SKIP.sub(" ", split_json_blocks(lark)[0])
    headers = list(_HEADER.finditer(text))
    refs: dict[str, set[str]] = {}
    for n, h in enumerate(headers):
        body_end = headers[n + 1].start() if n + 1 < len(headers) else len(text)
        body = text[h.end() : body_end]
        refs.setdefault(h.group(1), set()).update(_IDENT.findall(body))
    for name in refs:
        refs[name] &= refs.keys()
    depth: dict[str, int] = {}
    on_path: set[str] = set()
    for start in refs:
        stack: list[tuple[str, bool]] = [(start, False)]
        while stack:
            name, expanded = stack.pop()
            if expanded:
                on_path.discard(name)
                depth[name] = 1 + max((depth.get(r, 0) for r in refs[name]), default=0)
                continue
            if name in depth or name in on_path:
                continue
            on_path.add(name)
            stack.append((name, True))
            stack.extend((r, False) for r in refs[name] if r not in depth and r not in on_path)
    return max(depth.values(), default=0), len(headers)


def check_grammar(lark: str, field: str, bounds: ConstraintBounds) -> None:
    for block in split_json_blocks(lark)[1]:
        try:
            schema = json.loads(block)
        except (ValueError, RecursionError):
            continue  # not JSON: the grammar compiler reports it
        check_schema(schema, field, bounds)
    depth, rules = grammar_shape(lark)
    if rules > bounds.max_grammar_rules:
        raise too_complex(
            field,
            f"the grammar defines {rules} rules",
            bounds.max_grammar_rules,
            "--max-grammar-rules",
        )
    if depth > bounds.max_grammar_depth:
        raise too_complex(
            field,
            f"the grammar chains {depth} rules deep",
            bounds.max_grammar_depth,
            "--max-grammar-depth",
        )


def check_choices(count: int, field: str, bounds: ConstraintBounds) -> None:
    if count > bounds.max_choices:
        raise too_complex(field, f"{count} choices", bounds.max_choices, "--max-choices")
