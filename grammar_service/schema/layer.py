"""`prepare`: a JSON schema as llguidance can enforce it, the report, and what to check at run time.

The walk copies the schema object by object. A keyword llguidance enforces stays; one it lacks is
rewritten exactly (`rewrite`), dropped as an annotation (`formats`), or *relaxed*: dropped or
replaced by a superset (`oneOf` by `anyOf`, `if/then/else` by `anyOf` of `then`/`else`) and
registered for the output check at its location in the original schema. Relaxing only ever widens
what the grammar allows, so every valid instance stays reachable; `not` and `if` subschemas are
never handed to the grammar, so nothing is widened under a negation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grammar_service.schema import fallbacks, formats, rewrite
from grammar_service.schema.keywords import (
    ANNOTATIONS,
    COUNTS,
    GRAMMAR,
    MANY,
    MAP,
    ONE,
    STRUCTURAL,
    child,
    resolve,
    subschemas,
)
from grammar_service.schema.report import ANNOTATION, REWRITTEN, RUNTIME, Refused, Report

# Keywords the handlers below decide about (never copied as they are).
_HANDLED = frozenset(
    {
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "not",
        "if",
        "then",
        "else",
        "oneOf",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "format",
        "minProperties",
        "maxProperties",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
        "$recursiveAnchor",
    }
)
# Keywords that make "evaluated" depend on other subschemas (unevaluated* then needs the output).
_APPLICATORS = frozenset(
    {
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "dependentSchemas",
        "dependencies",
        "contains",
    }
)


class NeedsRuntime(Refused):
    """A keyword needs the output check, which this context (structural tags) does not have."""

    def __init__(self, keyword: str, location: str) -> None:
        super().__init__(
            keyword,
            location,
            "can only be checked on the output, which structural tags do not support",
        )


@dataclass(frozen=True)
class Prepared:
    schema: Any  # what llguidance compiles
    report: Report
    # Original-schema pointer -> keywords checked on the output there.
    runtime: dict[str, frozenset[str]]


def prepare(
    schema: dict[str, Any],
    mode: int,
    *,
    runtime: bool = True,
    relax: frozenset[str] = frozenset(),
) -> Prepared:
    """Run the layer over `schema` (not modified). `runtime` False: a keyword that would need
    the output check raises NeedsRuntime instead. `relax`: the `fallbacks` to apply, after
    llguidance refused the precise form."""
    walk = _Walk(schema, Report(mode=mode, validated=runtime), runtime, relax)
    out = walk.process(schema, "#")
    walk.relocate(out)
    return Prepared(out, walk.report, {p: frozenset(k) for p, k in walk.runtime.items()})


def grammar_keywords(schema: Any) -> set[str]:
    """The llguidance keywords a schema uses anywhere (strict mode's report)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(k for k in node if k in GRAMMAR)
            stack.extend(sub for _, _, sub in subschemas(node, "#"))
    return found


def _has_id(schema: Any) -> bool:
    return '"$id"' in json.dumps(schema)


Handler = Callable[["_Walk", dict[str, Any], str, dict[str, Any], list[Any]], None]


class _Walk:
    def __init__(
        self, root: dict[str, Any], report: Report, runtime_ok: bool, relax: frozenset[str]
    ) -> None:
        self.root = root
        self.report = report
        self.runtime_ok = runtime_ok
        self.relax_also = relax
        self.runtime: dict[str, set[str]] = {}
        self.formats = formats.for_schema(root)
        self._recursive: dict[str, bool] = {}
        # Original pointer -> the prepared schema object made for it (each is made once).
        self.done: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ helpers
    def resolve(self, node: Any) -> Any:
        """Follow local `$ref`s of a schema that is only a reference."""
        seen: set[str] = set()
        while (
            isinstance(node, dict)
            and isinstance(node.get("$ref"), str)
            and all(k == "$ref" or k in ANNOTATIONS for k in node)
            and node["$ref"] not in seen
        ):
            seen.add(node["$ref"])
            target = resolve(self.root, node["$ref"])
            if target is None:
                break
            node = target
        return node

    def relax(self, keyword: str, location: str, detail: str) -> None:
        if not self.runtime_ok:
            raise NeedsRuntime(keyword, location)
        self.report.add(keyword, location, RUNTIME, detail)
        self.runtime.setdefault(location, set()).add(keyword)

    def rewritten(self, keyword: str, location: str, detail: str) -> None:
        self.report.add(keyword, location, REWRITTEN, detail)

    def is_recursive(self, ref: str) -> bool:
        """Whether the target of a local `$ref` reaches itself through references."""
        if ref not in self._recursive:
            start = resolve(self.root, ref)
            self._recursive[ref] = start is not None and self._reaches(start, start)
        return self._recursive[ref]

    def _reaches(self, start: Any, goal: Any) -> bool:
        seen: set[int] = set()
        stack = [start]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict):
                ref = node.get("$ref")
                target = resolve(self.root, ref) if isinstance(ref, str) else None
                if target is goal:
                    return True
                if target is not None:
                    stack.append(target)
                stack.extend(v for v in node.values() if isinstance(v, dict | list))
            elif isinstance(node, list):
                stack.extend(v for v in node if isinstance(v, dict | list))
        return False

    # ------------------------------------------------------------------ the walk
    def process(self, node: Any, ptr: str) -> Any:
        if not isinstance(node, dict):
            return node
        if ptr in self.done:
            return self.done[ptr]
        out: dict[str, Any] = {}
        self.done[ptr] = out
        only_ref = self.ref_only(node, ptr)
        if only_ref is not None:
            out.update(only_ref)
            return out
        self._follow(node.get("$ref"))
        extra: list[Any] = []
        for key, value in node.items():
            if key in _HANDLED or ("$ref" in node and key in ANNOTATIONS - {"$id", "$anchor"}):
                continue
            if key in COUNTS and isinstance(value, float) and value.is_integer() and value >= 0:
                value = int(value)
                self.rewritten(key, ptr, f"{node[key]!r} as the integer {value}")
            out[key] = self._sub(key, value, ptr)
            if key in GRAMMAR:
                self.report.grammar.add(key)
        for handler in _HANDLERS:
            handler(self, node, ptr, out, extra)
        self._keep_resources(node, ptr, out)
        if extra:
            out["allOf"] = [*out.get("allOf", []), *extra]
        return out

    def _follow(self, ref: Any) -> None:
        """Prepare the target of a local `$ref` wherever it is (even under a keyword the layer
        drops or moves, or one it does not know): `relocate` then points the reference at it."""
        if isinstance(ref, str):
            target = resolve(self.root, ref)
            if isinstance(target, dict):
                self.process(target, ref if ref != "#/" else "#")

    def relocate(self, out: dict[str, Any]) -> None:
        """Point every local `$ref` of the prepared schema at the prepared object made for its
        target; targets that are no longer at their pointer are added under `$defs`."""
        defs: dict[str, Any] = {}
        names: dict[int, str] = {}
        stack: list[Any] = [out]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, list):
                stack.extend(node)
                continue
            if not isinstance(node, dict):
                continue
            ref = node.get("$ref")
            made = self.done.get(ref) if isinstance(ref, str) else None
            if made is not None and resolve(out, str(ref)) is not made:
                name = names.setdefault(id(made), f"maskwire:{len(names)}")
                defs[name] = made
                node["$ref"] = f"#/$defs/{name}"
                stack.append(made)  # its own references need the same treatment
            stack.extend(node.values())
        if defs:
            out["$defs"] = {**out.get("$defs", {}), **defs}

    def _keep_resources(self, node: dict[str, Any], ptr: str, out: dict[str, Any]) -> None:
        """Subschemas with an `$id` under a keyword that did not stay (e.g. `not`) may still be
        the target of a reference by that id: keep them in `$defs`, where ids are found."""
        for key, sub_ptr, sub in subschemas(node, ptr):
            if key not in out and _has_id(sub):
                defs = out.setdefault("$defs", {})
                defs[f"maskwire:{sub_ptr[len(ptr) + 1 :]}"] = self.process(sub, sub_ptr)

    def _sub(self, key: str, value: Any, ptr: str) -> Any:
        """A kept keyword's value with its subschemas prepared."""
        if key in MAP and isinstance(value, dict):
            return {n: self.process(s, child(ptr, key, n)) for n, s in value.items()}
        if key in MANY and isinstance(value, list):
            return [self.process(s, child(ptr, key, i)) for i, s in enumerate(value)]
        if key in ONE and isinstance(value, dict):
            return self.process(value, child(ptr, key))
        return value

    # ------------------------------------------------------------------ handlers
    def dependencies(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        required: list[tuple[str, str, list[str]]] = []
        schemas: list[tuple[str, str, Any]] = []
        for key in ("dependentRequired", "dependentSchemas", "dependencies"):
            value = node.get(key)
            if not isinstance(value, dict):
                continue
            for name, dep in value.items():
                if isinstance(dep, list):
                    required.append((key, name, [d for d in dep if isinstance(d, str)]))
                elif key != "dependentRequired":
                    schemas.append((key, name, dep))
        branches = 1
        for key, name, deps in required:
            if not deps:
                continue
            if branches * 2 > rewrite.MAX_BRANCHES:
                self.relax(key, ptr, f"'{name}' requires {deps}: too many combinations to rewrite")
                continue
            branches *= 2
            props = node.get("properties")
            order = list(props) if isinstance(props, dict) else []
            extra.append(rewrite.dependent_required(name, deps, order))
            self.rewritten(key, ptr, f"anyOf: '{name}' absent, or present with {deps}")
        for key, name, dep in schemas:
            sub = self.process(dep, child(ptr, key, name))
            if branches * 2 > rewrite.MAX_BRANCHES:
                self.relax(key, ptr, f"schema for '{name}': too many combinations to rewrite")
                continue
            branches *= 2
            extra.append(rewrite.dependent_schema(name, sub))
            self.rewritten(key, ptr, f"anyOf: '{name}' absent, or present and the schema holds")

    def negation(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        if "not" not in node:
            return
        where = child(ptr, "not")
        positive = rewrite.negate(
            node["not"], node, self.resolve, lambda s: self.process(s, child(where, "not"))
        )
        if positive is None:
            self.relax("not", ptr, "a negation the grammar cannot express")
            return
        extra.append(positive)
        self.rewritten("not", ptr, "as the remaining types / values / absent properties")

    def conditional(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        if "if" not in node:
            for key in ("then", "else"):
                if key in node:
                    self.report.add(key, ptr, ANNOTATION, "no effect without 'if'")
            return
        then = self.process(node.get("then", True), child(ptr, "then"))
        other = self.process(node.get("else", True), child(ptr, "else"))
        if then in (True, {}) and other in (True, {}):
            self.report.add("if", ptr, ANNOTATION, "no effect without 'then' or 'else'")
            return
        tests = rewrite.condition(node["if"], node, self.resolve)
        if tests is None:
            self.relax("if", ptr, "'if' tests more than properties against finite values")
            if "then" in node and "else" in node:
                extra.append({"anyOf": [then, other]})
            return
        holds, fails = tests
        extra.append(
            rewrite.any_of([rewrite.all_of([holds, then]), rewrite.all_of([fails, other])])
        )
        self.rewritten("if", ptr, "anyOf: the tested values with 'then', the others with 'else'")

    def one_of(self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]) -> None:
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            return
        prepared = [self.process(b, child(ptr, "oneOf", i)) for i, b in enumerate(branches)]
        why = rewrite.disjoint(branches, self.resolve)
        if why is None:
            self.relax("oneOf", ptr, "branches may overlap: exactly one checked on the output")
        else:
            self.rewritten("oneOf", ptr, f"as anyOf: the branches are disjoint ({why})")
        extra.append({"anyOf": prepared} if prepared else False)

    def unique(self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]) -> None:
        if node.get("uniqueItems") is not True:
            if "uniqueItems" in node:
                self.report.grammar.add("uniqueItems")  # false: no constraint to enforce
            return
        arrays = rewrite.unique_arrays(out, self.resolve)
        if arrays is None:
            self.relax("uniqueItems", ptr, "items are open: duplicates masked as items complete")
            return
        extra.append(arrays)
        self.rewritten("uniqueItems", ptr, "every array of distinct item values, spelt out")

    def contains(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        for key in ("contains", "minContains", "maxContains"):
            if key not in node:
                continue
            if "contains" in node:
                self.relax(key, ptr, "counted on the output as items complete")
            else:
                self.report.add(key, ptr, ANNOTATION, "no effect without 'contains'")

    def property_names(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        if "propertyNames" not in node:
            return
        replaced = rewrite.property_names(out, node["propertyNames"])
        if replaced is None:
            self.relax("propertyNames", ptr, "each name checked on the output as it completes")
            return
        out.update(replaced)
        self.rewritten("propertyNames", ptr, "as the allowed properties / a name pattern")

    def property_counts(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        keys = [k for k in ("minProperties", "maxProperties") if k in node]
        if not keys:
            return
        props = out.get("properties", {})
        required = out.get("required", [])
        enforceable = isinstance(props, dict) and isinstance(required, list)
        if enforceable and set(props) <= set(required):
            for key in keys:
                value = node[key]
                if isinstance(value, float) and value.is_integer() and value >= 0:
                    self.rewritten(key, ptr, f"{value!r} as the integer {int(value)}")
                    value = int(value)
                out[key] = value
                self.report.grammar.add(key)
            return
        for key in keys:
            self.relax(key, ptr, "optional properties listed: counted on the output")

    def unevaluated(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        plain = not any(k in node for k in _APPLICATORS)
        for key, target in (
            ("unevaluatedProperties", "additionalProperties"),
            ("unevaluatedItems", "items"),
        ):
            if key not in node:
                continue
            if not plain or (key == "unevaluatedItems" and isinstance(node.get("items"), list)):
                self.relax(key, ptr, "depends on other subschemas: checked on the output")
            elif target in node:
                self.rewritten(key, ptr, f"no effect beside '{target}'")
            else:
                out[target] = self.process(node[key], child(ptr, key))
                self.rewritten(key, ptr, f"as '{target}' (no applicator beside it)")

    def fallbacks(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        """The broader relaxations a retry asked for (`fallbacks`), where their forms occur."""
        if not self.relax_also:
            return
        if "patterns" in self.relax_also:
            fallbacks.merge_patterns(out, ptr, self.relax)
        if "patterns_folded" in self.relax_also:
            fallbacks.fold_patterns(out, ptr, self.relax)
        if "strings" in self.relax_also:
            fallbacks.loosen_strings(out, ptr, self.relax)
        if "intersections" in self.relax_also:
            fallbacks.thin_intersections(out, ptr, self.relax, self.is_recursive)

    def format(self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]) -> None:
        name = node.get("format")
        if not isinstance(name, str):
            return
        steer = self.formats.decide(name, ptr)
        if steer is None:
            self.report.add("format", ptr, ANNOTATION, f"'{name}': unknown format, an annotation")
            return
        if steer.native:
            out["format"] = steer.native
        elif "pattern" in out:  # both must hold: llguidance intersects allOf members
            extra.append({"pattern": f"^(?:{steer.pattern})$"})
        else:
            out["pattern"] = f"^(?:{steer.pattern})$"
        if steer.max_length is not None:
            given = out.get("maxLength")
            out["maxLength"] = (
                min(given, steer.max_length) if isinstance(given, int) else steer.max_length
            )
        if steer.native and steer.max_length is None:
            self.report.grammar.add("format")
        else:
            self.report.add("format", ptr, REWRITTEN, steer.describe(name))

    def dynamic(
        self, node: dict[str, Any], ptr: str, out: dict[str, Any], extra: list[Any]
    ) -> None:
        if isinstance(node.get("$dynamicAnchor"), str) and "$anchor" not in node:
            out["$anchor"] = node["$dynamicAnchor"]  # it is a plain anchor for static $refs too
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in node:
                self.relax(key, ptr, "resolved by the output check")

    def ref_only(self, node: dict[str, Any], ptr: str) -> dict[str, Any] | None:
        """A `$ref` with keywords beside it, as llguidance takes it: annotations go (it refuses
        them beside a reference in a cycle), and when the target is recursive so do the
        assertions, which the output check then enforces. None: nothing to change."""
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return None
        kept = {"$ref", "$id", "$anchor", *STRUCTURAL}
        recursive = self.is_recursive(ref)
        beside = [k for k in node if k not in kept and (recursive or k in ANNOTATIONS)]
        if not beside:
            return None
        for key in beside:
            if key not in ANNOTATIONS:
                self.relax(key, ptr, "beside a recursive $ref")
        if recursive:
            self._follow(ref)
            return {k: self._sub(k, v, ptr) for k, v in node.items() if k in kept}
        return None


_HANDLERS: tuple[Handler, ...] = (
    _Walk.dependencies,
    _Walk.negation,
    _Walk.conditional,
    _Walk.one_of,
    _Walk.unique,
    _Walk.contains,
    _Walk.property_names,
    _Walk.property_counts,
    _Walk.unevaluated,
    _Walk.fallbacks,
    _Walk.format,
    _Walk.dynamic,
)
