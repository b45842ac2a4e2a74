"""Exact rewrites: keywords llguidance lacks, as equivalent schemas built from keywords it has.

Each function returns the replacement (to be intersected with the schema object, i.e. added to
its `allOf`) or None when the form is not one it can rewrite exactly; the layer then relaxes the
keyword and checks it on the output instead. "Absent" is `{"properties": {p: false}}`: a present
`p` would have to validate against `false`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from grammar_service.schema.keywords import ANNOTATIONS, KINDS, canon, kinds_of, value_type
from grammar_service.schema.patterns import PatternError, search

Resolver = Callable[[Any], Any]

# Most `anyOf` branches one rewrite may add (llguidance distributes intersections over them).
MAX_BRANCHES = 64


def absent(name: str) -> dict[str, Any]:
    return {"properties": {name: False}}


def _only(node: Any, *keys: str) -> bool:
    """`node` is an object schema with no keywords but `keys` (and annotations)."""
    return isinstance(node, dict) and all(k in keys or k in ANNOTATIONS for k in node)


def any_of(branches: list[Any]) -> Any:
    """`anyOf` of the branches, without the false ones (false when none is left)."""
    live = [b for b in branches if b is not False]
    if not live:
        return False
    return live[0] if len(live) == 1 else {"anyOf": live}


def all_of(parts: list[Any]) -> Any:
    """`allOf` of the parts, without the true ones (true when none is left)."""
    live = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in live):
        return False
    if not live:
        return True
    return live[0] if len(live) == 1 else {"allOf": live}


# ------------------------------------------------------------------ dependencies
def dependent_required(name: str, deps: list[str], order: list[str]) -> dict[str, Any]:
    """`dependentRequired: {name: deps}`: `name` absent, or present with `deps`. llguidance
    writes required properties in the order they are listed, so they follow `order` (the
    object's `properties`), then the property before its dependents."""
    rank = {n: i for i, n in enumerate(order)}
    given = [name, *deps]
    names = sorted(range(len(given)), key=lambda i: (rank.get(given[i], len(rank)), i))
    return {"anyOf": [absent(name), {"required": [given[i] for i in names]}]}


def dependent_schema(name: str, schema: Any) -> Any:
    """`dependentSchemas: {name: schema}` (`schema` already prepared)."""
    if schema is True or schema == {}:
        return True
    if schema is False:
        return absent(name)
    return {"anyOf": [absent(name), {"required": [name], "allOf": [schema]}]}


# ------------------------------------------------------------------ finite domains
def domain(node: Any, resolve: Resolver) -> list[Any] | None:
    """The values a schema allows when they are finitely many and it says so directly (`const`,
    `enum`, boolean or null type); None otherwise."""
    node = resolve(node)
    if not isinstance(node, dict):
        return None
    values: list[Any] | None = None
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = list(node["enum"])
    kinds = kinds_of(node)
    if values is None and kinds is not None and kinds <= {"boolean", "null"}:
        values = ([True, False] if "boolean" in kinds else []) + ([None] if "null" in kinds else [])
    if values is None:
        return None
    if isinstance(node.get("type"), str | list):
        allowed = kinds_of({"type": node["type"]}) or frozenset()
        integer_only = node["type"] in ("integer", ["integer"])
        values = [
            v
            for v in values
            if _kind(v) in allowed and (not integer_only or value_type(v) == "integer")
        ]
    return _distinct(values)


def _kind(value: Any) -> str:
    t = value_type(value)
    return "number" if t == "integer" else t


def _distinct(values: list[Any]) -> list[Any]:
    seen: set[Any] = set()
    out = []
    for v in values:
        c = canon(v)
        if c not in seen:
            seen.add(c)
            out.append(v)
    return out


def _without(values: list[Any], removed: list[Any]) -> list[Any]:
    gone = {canon(v) for v in removed}
    return [v for v in values if canon(v) not in gone]


# ------------------------------------------------------------------ not
def negate(sub: Any, node: dict[str, Any], resolve: Resolver, positive: Resolver) -> Any:
    """A positive schema equal to `{"not": sub}` inside `node`, or None. `positive(s)` prepares
    a subschema that ends up un-negated (`not: {not: s}`)."""
    if sub is True or _only(sub):
        return False
    if sub is False:
        return True
    if _only(sub, "not"):
        return positive(sub["not"])
    if _only(sub, "required") and isinstance(sub["required"], list):
        names = [n for n in sub["required"] if isinstance(n, str)]
        return any_of([absent(n) for n in names]) if names else False
    if _only(sub, "type"):
        return _not_type(sub["type"])
    if _only(sub, "enum") or _only(sub, "const"):
        values = [sub["const"]] if "const" in sub else sub["enum"]
        own = domain(node, resolve)
        if not isinstance(values, list) or own is None:
            return None
        return {"enum": _without(own, values)}
    if _only(sub, "anyOf") and isinstance(sub["anyOf"], list):
        parts = [negate(s, node, resolve, positive) for s in sub["anyOf"]]
        return None if any(p is None for p in parts) else all_of(parts)
    if _only(sub, "allOf") and isinstance(sub["allOf"], list):
        parts = [negate(s, node, resolve, positive) for s in sub["allOf"]]
        return None if any(p is None for p in parts) else any_of(parts)
    return None


def _not_type(t: Any) -> Any:
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    if "integer" in names and "number" not in names:
        return None  # "a number that is not whole" has no keyword llguidance enforces
    rest = [k for k in KINDS if k not in names and not (k == "number" and "integer" in names)]
    return {"type": rest} if rest else False


# ------------------------------------------------------------------ if / then / else
def condition(if_schema: Any, node: dict[str, Any], resolve: Resolver) -> tuple[Any, Any] | None:
    """(holds, fails): positive schemas for "`if` validates" and "it does not", when `if` tests
    properties of an object against finitely many values (or their presence). None otherwise."""
    if if_schema is True or _only(if_schema):
        return True, False
    if if_schema is False:
        return False, True
    if not _only(if_schema, "properties", "required", "type"):
        return None
    if "type" in if_schema and kinds_of(node) != frozenset({"object"}):
        return None  # `if: {type: object}` only adds nothing when the node is an object
    if "type" in if_schema and kinds_of({"type": if_schema["type"]}) != frozenset({"object"}):
        return None
    tests = if_schema.get("properties", {})
    required = if_schema.get("required", [])
    if not isinstance(tests, dict) or not isinstance(required, list):
        return None
    props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
    holds: list[Any] = []
    fails: list[Any] = []
    for name, test in tests.items():
        values = domain(test, resolve) if test is not True else None
        if test is True or test == {}:
            continue  # any value passes
        if values is None:
            return None
        whole = domain(props.get(name, True), resolve)
        if whole is None:
            return None
        holds.append({"properties": {name: {"enum": values}}})
        rest = _without(whole, values)
        if rest:
            fails.append({"required": [name], "properties": {name: {"enum": rest}}})
    for name in required:
        if not isinstance(name, str):
            return None
        holds.append({"required": [name]})
        fails.append(absent(name))
    return all_of(holds), any_of(fails)


# ------------------------------------------------------------------ oneOf
def disjoint(branches: list[Any], resolve: Resolver) -> str | None:
    """Why no instance can match two of `branches` (their own keywords prove it), or None."""
    resolved = [resolve(b) for b in branches]
    reasons = set()
    for a, b in itertools.combinations(resolved, 2):
        why = _pair_disjoint(a, b, resolve)
        if why is None:
            return None
        reasons.add(why)
    return " / ".join(sorted(reasons)) or "one branch"


def _pair_disjoint(a: Any, b: Any, resolve: Resolver) -> str | None:
    if a is False or b is False:
        return "a branch is false"
    ka, kb = kinds_of(a), kinds_of(b)
    if ka is not None and kb is not None and not ka & kb:
        return "different types"
    da, db = domain(a, resolve), domain(b, resolve)
    if da is not None and db is not None and not _overlap(da, db):
        return "different values"
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    for x, y in ((a, b), (b, a)):
        for name in _required(x):
            if _forbids(y, name):
                return f"'{name}' required in one branch and forbidden in the other"
            if name in _required(y):
                vx = domain(_prop(x, name), resolve)
                vy = domain(_prop(y, name), resolve)
                if vx is not None and vy is not None and not _overlap(vx, vy):
                    return f"different values of '{name}'"
    return None


def _overlap(a: list[Any], b: list[Any]) -> bool:
    return bool({canon(v) for v in a} & {canon(v) for v in b})


def _required(node: dict[str, Any]) -> list[str]:
    r = node.get("required", [])
    return [n for n in r if isinstance(n, str)] if isinstance(r, list) else []


def _prop(node: dict[str, Any], name: str) -> Any:
    props = node.get("properties")
    return props.get(name, True) if isinstance(props, dict) else True


def _forbids(node: dict[str, Any], name: str) -> bool:
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    assert isinstance(props, dict)
    if name in props:
        return props[name] is False
    return node.get("additionalProperties") is False and not node.get("patternProperties")


# ------------------------------------------------------------------ uniqueItems
def unique_arrays(node: dict[str, Any], resolve: Resolver) -> Any:
    """`uniqueItems: true` over a finite item domain, as every array of distinct values spelt
    out (prefixItems of consts); None when the domain is not finite or the arrays too many."""
    if "prefixItems" in node or "contains" in node or not isinstance(node.get("items"), dict):
        return None
    values = domain(node["items"], resolve)
    if values is None:
        return None
    n = len(values)
    lo = node.get("minItems", 0)
    hi = node.get("maxItems", n)
    if not isinstance(lo, int) or not isinstance(hi, int):
        return None
    lengths = range(max(lo, 0), min(hi, n) + 1)
    if sum(math.perm(n, k) for k in lengths) > MAX_BRANCHES:
        return None
    arrays = [
        {"prefixItems": [{"const": v} for v in p], "items": False, "minItems": k}
        for k in lengths
        for p in itertools.permutations(values, k)
    ]
    return any_of(arrays)


# ------------------------------------------------------------------ propertyNames
def property_names(node: dict[str, Any], names: Any) -> dict[str, Any] | None:
    """The node's `properties` / `patternProperties` / `additionalProperties` rewritten so that
    only names valid under `propertyNames` can appear, or None. Exact only where the node's
    other property keywords leave room for it (no patternProperties; additional properties, if
    allowed at all, unconstrained)."""
    if "patternProperties" in node:
        return None
    props = node.get("properties", {})
    if not isinstance(props, dict):
        return None
    extra = node.get("additionalProperties", True)
    if names is True or names == {}:
        return {}
    if names is False:
        return {"properties": dict.fromkeys(props, False), "additionalProperties": False}
    allowed = domain(names, lambda s: s)
    if allowed is not None:
        keys = [v for v in allowed if isinstance(v, str)]
        out = {k: (v if k in keys else False) for k, v in props.items()}
        if extra is not False:
            out.update({k: extra for k in keys if k not in props})
        return {"properties": out, "additionalProperties": False}
    if extra not in (True, {}) or not _only(names, "pattern", "minLength", "maxLength", "type"):
        return None
    if names.get("type", "string") != "string":
        return None
    pattern = _name_pattern(names)
    if pattern is None:
        return None
    try:
        out = {k: (v if search(pattern, k) else False) for k, v in props.items()}
    except PatternError:
        return None  # relaxed: the output check then refuses the schema (`guard`)
    return {"properties": out, "patternProperties": {pattern: {}}, "additionalProperties": False}


def _name_pattern(names: dict[str, Any]) -> str | None:
    has_len = "minLength" in names or "maxLength" in names
    if "pattern" in names:
        return str(names["pattern"]) if not has_len else None
    lo, hi = names.get("minLength", 0), names.get("maxLength")
    if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
        return None
    return f"^[\\s\\S]{{{lo},{'' if hi is None else hi}}}$"
