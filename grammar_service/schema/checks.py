"""`OutputChecks`: what the output check knows about one schema, shared by its requests.

* the validator of the original schema (jsonschema, the schema's own draft, format checking on):
  the finished output must pass it;
* the run-time keywords the layer registered, by their location in the original schema, and how
  an output location maps to schema locations that certainly apply there.

Every validator resolves references through `registry.OFFLINE` (nothing outside the schema as sent,
never fetched) and matches patterns with RE2 (`patterns`), also where jsonschema's own keywords
would use Python's backtracking `re` (`additionalProperties`, `unevaluatedProperties`, `format:
regex`); `guard.check` refuses, before any of it runs, a schema it could not run that way.

"Certainly applies" follows `properties`, `patternProperties`, `additionalProperties`, `items`,
`prefixItems`, local `$ref`s and `allOf`, and an `anyOf`/`oneOf` branch when it is the only one
that admits the value's type. A keyword under another applicator (a branch among several, `not`,
`if`) may or may not apply to a value, so only the final validation of the whole output sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema
import referencing.jsonschema
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from grammar_service.schema import guard
from grammar_service.schema.keywords import canon, child, kinds_of, resolve, subschemas
from grammar_service.schema.patterns import is_regex, search
from grammar_service.schema.registry import OFFLINE

# Child-location lookups remembered per schema (keys are output strings: bounded).
_MEMO_LIMIT = 4096

Nodes = tuple[str, ...]


@dataclass(frozen=True)
class NodeChecks:
    """The run-time checks of one schema location."""

    value: bool  # validate a completed value against the location's subschema
    unique: bool  # uniqueItems: an item equal to an earlier one is a violation
    max_properties: int | None  # a member past this count is a violation
    names: str | None  # location of `propertyNames`: each key must validate against it
    contains: tuple[str, int] | None  # (`contains` location, maxContains)

    @property
    def items(self) -> bool:
        return self.unique or self.contains is not None


_NONE = NodeChecks(False, False, None, None, None)
_PREFIX_CHECKED = frozenset({"uniqueItems", "maxProperties", "propertyNames"})
_CERTAIN = frozenset(
    {
        "properties",
        "patternProperties",
        "additionalProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "allOf",
    }
)


def first_error(validator: Validator, value: Any) -> str | None:
    """The first violation's message, or None when `value` is valid."""
    try:
        err = next(iter(validator.iter_errors(value)), None)
    except Exception as e:  # e.g. a reference relative to an `$id` a location is checked without
        return f"cannot validate: {e}"
    if err is None:
        return None
    where = "".join(f"[{p!r}]" for p in err.absolute_path)
    return f"{where or 'value'}: {err.message}"[:500]


class OutputChecks:
    def __init__(
        self,
        schema: Any,
        runtime: dict[str, frozenset[str]],
        field: str = "constraint.json_schema",
    ) -> None:
        """`RpcError(INVALID_ARGUMENT)` on `field` when the check could not run `schema`
        safely (`guard.check`)."""
        guard.check(schema, field)
        self.schema = schema
        self.validator: Validator = new_validator(schema)
        self.runtime = runtime
        # Tier 1 (a scanner follows the output) only when some keyword is checked at run time;
        # otherwise the finished output is validated and nothing else.
        self.tracked = bool(runtime)
        self._memo: dict[tuple[Nodes, str | int, str], Nodes] = {}
        self._relevant: frozenset[str] | None = None
        self._validators: dict[str, Validator] = {}
        self._checks: dict[str, NodeChecks] = {}
        # (location, scalar) -> verdict: the mask tries many tokens that complete the same key
        # or string, and requests of one schema see the same ones again.
        self._scalars: dict[tuple[str, Any], str | None] = {}

    # ------------------------------------------------------------------ validation
    def document_error(self, value: Any) -> str | None:
        return first_error(self.validator, value)

    def node_error(self, ptr: str, value: Any) -> str | None:
        scalar = value is None or isinstance(value, str | int | float)
        if scalar:
            key = (ptr, canon(value))
            if key in self._scalars:
                return self._scalars[key]
        if ptr == "#":
            err = self.document_error(value)
        else:
            validator = self._validators.get(ptr)
            if validator is None:
                validator = self.validator.evolve(schema=resolve(self.schema, ptr))
                self._validators[ptr] = validator
            err = first_error(validator, value)
        if scalar:
            if len(self._scalars) >= _MEMO_LIMIT:
                self._scalars.clear()
            self._scalars[key] = err
        return err

    # ------------------------------------------------------------------ locations
    def checks(self, ptr: str) -> NodeChecks:
        found = self._checks.get(ptr)
        if found is None:
            found = self._checks[ptr] = self._node_checks(ptr)
        return found

    def _node_checks(self, ptr: str) -> NodeChecks:
        keys = self.runtime.get(ptr)
        if ptr != "#" and not keys:
            return _NONE
        node = resolve(self.schema, ptr)
        if not isinstance(node, dict):
            return _NONE
        keys = keys or frozenset()
        max_props = node.get("maxProperties") if "maxProperties" in keys else None
        max_contains = node.get("maxContains") if "contains" in node else None
        return NodeChecks(
            # Keywords checked as items, keys and members arrive need no check at the end. The
            # whole output is checked as it completes only when that can find more.
            value=self._steer_document() if ptr == "#" else bool(keys - _PREFIX_CHECKED),
            unique="uniqueItems" in keys,
            max_properties=max_props if isinstance(max_props, int) else None,
            names=child(ptr, "propertyNames") if "propertyNames" in keys else None,
            contains=(child(ptr, "contains"), max_contains)
            if "contains" in keys and isinstance(max_contains, int)
            else None,
        )

    def _steer_document(self) -> bool:
        """Whether checking the whole output as its last token is chosen can find what the
        checks at certain locations do not: a run-time keyword at the root that needs the end,
        or one at a location that may not apply (under anyOf, oneOf, not, if, ...)."""
        if self.runtime.get("#", frozenset()) - _PREFIX_CHECKED:
            return True
        certain = self._certain()
        return any(p not in certain for p in self.runtime)

    def _certain(self) -> set[str]:
        """Locations that apply whenever their value exists (see the module docstring)."""
        found: set[str] = set()
        stack = ["#"]
        while stack:
            ptr = stack.pop()
            node = resolve(self.schema, ptr)
            if ptr in found or not isinstance(node, dict):
                continue
            found.add(ptr)
            stack.extend(p for key, p, _ in subschemas(node, ptr) if key in _CERTAIN)
            ref = node.get("$ref")
            if isinstance(ref, str):
                stack.append(ref if ref != "#/" else "#")
        return found

    def start(self, kind: str) -> Nodes:
        """The locations that certainly apply to the whole output, a value of `kind`."""
        return self._expand(["#"], kind)

    def child(self, nodes: Nodes, key: str | int, kind: str) -> Nodes:
        """The locations that certainly apply to member `key` (a string) or item `key` (an
        int) of a value at `nodes`, itself a value of `kind`."""
        memo_key = (nodes, key, kind)
        found = self._memo.get(memo_key)
        if found is None:
            found = self._expand([p for n in nodes for p in self._direct(n, key)], kind)
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[memo_key] = found
        return found

    def _direct(self, ptr: str, key: str | int) -> list[str]:
        node = resolve(self.schema, ptr)
        if not isinstance(node, dict):
            return []
        if isinstance(key, int):
            prefix = node.get("prefixItems")
            items = node.get("items")
            if isinstance(prefix, list):
                if key < len(prefix):
                    return [child(ptr, "prefixItems", key)]
                return [child(ptr, "items")] if isinstance(items, dict) else []
            if isinstance(items, list):  # drafts before 2020-12
                if key < len(items):
                    return [child(ptr, "items", key)]
                extra = node.get("additionalItems")
                return [child(ptr, "additionalItems")] if isinstance(extra, dict) else []
            return [child(ptr, "items")] if isinstance(items, dict) else []
        out = []
        props = node.get("properties")
        if isinstance(props, dict) and key in props:
            out.append(child(ptr, "properties", key))
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            out.extend(child(ptr, "patternProperties", p) for p in patterns if search(p, key))
        if not out and isinstance(node.get("additionalProperties"), dict):
            out.append(child(ptr, "additionalProperties"))
        return out

    def _expand(self, start: list[str], kind: str) -> Nodes:
        """`start` and everything that certainly applies with it, kept when it has checks at
        or below it."""
        relevant = self.relevant()
        out: list[str] = []
        seen: set[str] = set()
        stack = list(reversed(start))
        while stack:
            ptr = stack.pop()
            if ptr in seen:
                continue
            seen.add(ptr)
            node = resolve(self.schema, ptr)
            if not isinstance(node, dict):
                continue
            if ptr in relevant:
                out.append(ptr)
            ref = node.get("$ref")
            if isinstance(ref, str) and resolve(self.schema, ref) is not None:
                stack.append(ref if ref != "#/" else "#")
            for i, _ in enumerate(node.get("allOf") or []):
                stack.append(child(ptr, "allOf", i))
            for key in ("anyOf", "oneOf"):
                branches = node.get(key)
                if isinstance(branches, list):
                    fits = [i for i, b in enumerate(branches) if _admits(b, kind, self.schema)]
                    if len(fits) == 1:
                        stack.append(child(ptr, key, fits[0]))
        return tuple(out)

    def relevant(self) -> frozenset[str]:
        """Locations from which a location with run-time checks is certainly reachable."""
        if self._relevant is None:
            self._relevant = self._reaching({*self.runtime, "#"})
        return self._relevant

    def _reaching(self, targets: set[str]) -> frozenset[str]:
        back: dict[str, set[str]] = {}
        stack: list[tuple[str, Any]] = [("#", self.schema)]
        seen: set[str] = set()
        while stack:
            ptr, node = stack.pop()
            if ptr in seen or not isinstance(node, dict):
                continue
            seen.add(ptr)
            for _, sub_ptr, sub in subschemas(node, ptr):
                back.setdefault(sub_ptr, set()).add(ptr)
                stack.append((sub_ptr, sub))
            ref = node.get("$ref")
            if isinstance(ref, str):
                back.setdefault(ref if ref != "#/" else "#", set()).add(ptr)
        found = set()
        todo = [t for t in targets if t != "#"]
        while todo:
            ptr = todo.pop()
            if ptr in found:
                continue
            found.add(ptr)
            todo.extend(back.get(ptr, ()))
        return frozenset(found | {"#"})


def _admits(branch: Any, kind: str, root: Any) -> bool:
    node = branch
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and len(node) == 1:
        ref = node["$ref"]
        if ref in seen:
            break
        seen.add(ref)
        node = resolve(root, ref)
    kinds = kinds_of(node)
    return kinds is None or kind in kinds


# ------------------------------------------------------------------ jsonschema, made safe
def _pattern(validator: Validator, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Validator, patterns: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, sub in patterns.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, sub, path=key, schema_path=pattern)


def _matches_a_pattern(schema: Any, key: str) -> bool:
    patterns = schema.get("patternProperties")
    return isinstance(patterns, dict) and any(search(p, key) for p in patterns)


def _additional_properties(validator: Validator, extra: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's `additionalProperties`, with its patternProperties matched by RE2."""
    if not validator.is_type(instance, "object"):
        return
    listed = schema.get("properties", {})
    extras = [k for k in instance if k not in listed and not _matches_a_pattern(schema, k)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        names = ", ".join(repr(k) for k in sorted(extras))
        yield ValidationError(f"Additional properties are not allowed ({names} unexpected)")


def _valid(validator: Validator, instance: Any, schema: Any) -> bool:
    return next(validator.descend(instance, schema), None) is None


def _evaluated_keys(validator: Any, instance: dict[str, Any], schema: Any) -> set[str]:
    """The members of `instance` that `schema` evaluates successfully, found as jsonschema's
    draft 2020-12 `unevaluatedProperties` finds them, with patterns matched by RE2."""
    if not isinstance(schema, dict):
        return set()
    found: set[str] = set()
    targets = [
        validator._resolver.lookup(r)
        for r in (schema.get("$ref"), schema.get("$dynamicRef"))
        if isinstance(r, str)
    ]
    if "$recursiveRef" in schema:
        targets.append(referencing.jsonschema.lookup_recursive_ref(validator._resolver))
    for got in targets:
        inner = validator.evolve(schema=got.contents, _resolver=got.resolver)
        found |= _evaluated_keys(inner, instance, got.contents)
    props = schema.get("properties")
    if isinstance(props, dict):
        found |= props.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if keyword in schema:
            found |= {k for k, v in instance.items() if _valid(validator, v, schema[keyword])}
    found |= {k for k in instance if _matches_a_pattern(schema, k)}
    dependent = schema.get("dependentSchemas")
    if isinstance(dependent, dict):
        for name, sub in dependent.items():
            if name in instance:
                found |= _evaluated_keys(validator, instance, sub)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for sub in schema.get(keyword) or ():
            if _valid(validator, instance, sub):
                found |= _evaluated_keys(validator, instance, sub)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            found |= _evaluated_keys(validator, instance, schema["if"])
            found |= _evaluated_keys(validator, instance, schema.get("then"))
        else:
            found |= _evaluated_keys(validator, instance, schema.get("else"))
    return found


def _unevaluated_properties(validator: Validator, extra: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's `unevaluatedProperties`, with patternProperties matched by RE2."""
    if not validator.is_type(instance, "object"):
        return
    evaluated = _evaluated_keys(validator, instance, schema)
    bad = [k for k in instance if k not in evaluated and not _valid(validator, instance[k], extra)]
    if bad and extra is False:
        names = ", ".join(repr(k) for k in sorted(bad))
        yield ValidationError(f"Unevaluated properties are not allowed ({names} unexpected)")
    elif bad:
        names = ", ".join(repr(k) for k in bad)
        yield ValidationError(f"Unevaluated properties are not valid ({names} invalid)")


_SAFE_KEYWORDS = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "unevaluatedProperties": _unevaluated_properties,
}


def _format_checker(base: jsonschema.FormatChecker) -> jsonschema.FormatChecker:
    """`base` with `regex` checked by RE2: compiling an output with Python's `re` can take
    seconds (case-folded ranges), RE2 compiles in time linear in the text."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    if "regex" in checker.checkers:
        checker.checks("regex")(lambda value: not isinstance(value, str) or is_regex(value))
    return checker


_CLASSES: dict[type, Any] = {}


def validator_class(schema: Any) -> Any:
    """The jsonschema validator class for `schema`'s draft, with format checking and patterns
    matched by RE2; validate with `new_validator` (its registry never retrieves)."""
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls = _CLASSES.get(base)
    if cls is None:
        own = {k: f for k, f in _SAFE_KEYWORDS.items() if k in base.VALIDATORS}
        cls = jsonschema.validators.extend(base, own)
        cls.FORMAT_CHECKER = _format_checker(base.FORMAT_CHECKER)
        _CLASSES[base] = cls
    return cls


def new_validator(schema: Any) -> Validator:
    """A validator of `schema` as the output check uses it: its draft, format checking on,
    patterns by RE2, references only inside the schema and the bundled metaschemas."""
    cls = validator_class(schema)
    validator: Validator = cls(schema, format_checker=cls.FORMAT_CHECKER, registry=OFFLINE)
    return validator
