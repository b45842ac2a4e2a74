"""Broader relaxations, used only after llguidance refused the precisely prepared schema.

Some refusals depend on how llguidance combines subschemas (are two patterns disjoint, is an
intersection of regexes empty, how deep intersections of recursive references go), which the
layer cannot predict. The compile then retries with the next relaxation for that message: each
one only widens what the grammar allows (the output check enforces the rest) and is applied
wherever its form occurs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grammar_service.schema.keywords import child
from grammar_service.schema.rewrite import any_of

# llguidance's message fragment -> relaxations to try for it, in order.
_STEPS = {
    "patternProperty regexes": ("patterns", "patterns_folded"),
    "Unable to determine if regex is empty": ("strings",),
    "Schema intersection stack level exceeded": ("intersections",),
}

Relax = Callable[[str, str, str], None]  # (keyword, location, detail)


def next_fallback(message: str, tried: frozenset[str]) -> str | None:
    """The relaxation to retry with after llguidance refused a prepared schema with `message`
    (None: there is none left)."""
    for text, steps in _STEPS.items():
        if text in message:
            return next((s for s in steps if s not in tried), None)
    return None


def merge_patterns(out: dict[str, Any], ptr: str, relax: Relax) -> None:
    """`patterns`: llguidance needs one object's patternProperties to be disjoint; overlapping
    ones become one pattern whose schema is the anyOf of theirs."""
    given = out.get("patternProperties")
    if isinstance(given, dict) and len(given) > 1:
        merged = "|".join(f"(?:{p})" for p in given)
        out["patternProperties"] = {merged: {"anyOf": list(given.values())}}
        relax("patternProperties", ptr, "overlapping patterns merged into one")


def fold_patterns(out: dict[str, Any], ptr: str, relax: Relax) -> None:
    """`patterns_folded`: patterns of objects that are intersected (allOf) must be disjoint too;
    no patterns at all then: their schemas join `additionalProperties` (when it says anything)."""
    given = out.pop("patternProperties", None)
    if not isinstance(given, dict) or not given:
        return
    extra = out.get("additionalProperties", True)
    if extra not in (True, {}):
        out["additionalProperties"] = any_of([*given.values(), extra])
    relax("patternProperties", ptr, "dropped from the grammar (patterns of intersected objects)")


def loosen_strings(out: dict[str, Any], ptr: str, relax: Relax) -> None:
    """`strings`: llguidance cannot always decide whether intersected string regexes (patterns
    of allOf members, a pattern with length bounds) are empty: keep only the object's own
    pattern or its lengths."""
    if "pattern" in out:
        for key in ("minLength", "maxLength"):
            if out.pop(key, None) is not None:
                relax(key, ptr, "beside a pattern the grammar cannot intersect with it")
    for i, member in enumerate(out.get("allOf") or []):
        if isinstance(member, dict):
            for key in ("pattern", "minLength", "maxLength"):
                if member.pop(key, None) is not None:
                    relax(key, child(ptr, "allOf", i), "intersected string regexes")


def thin_intersections(
    out: dict[str, Any], ptr: str, relax: Relax, recursive: Callable[[str], bool]
) -> None:
    """`intersections`: llguidance expands intersections of recursive references eagerly; an
    allOf keeps the first such reference only."""
    members = out.get("allOf")
    if not isinstance(members, list):
        return
    kept: list[Any] = []
    seen_recursive = False
    for i, m in enumerate(members):
        ref = m.get("$ref") if isinstance(m, dict) and len(m) == 1 else None
        if isinstance(ref, str) and recursive(ref):
            if seen_recursive:
                relax("allOf", child(ptr, "allOf", i), "a second recursive reference intersected")
                continue
            seen_recursive = True
        kept.append(m)
    out["allOf"] = kept
