"""`format`: which names the grammar enforces, which the output check does, which are annotations.

In draft 2020-12 `format` only asserts when the format-assertion vocabulary is on; by default it
is an annotation. The layer keeps the formats llguidance implements in the grammar, drops the
rest from it, and the output check (jsonschema's format checker, as the rule's validator uses it)
enforces the names that checker knows. A name neither knows constrains nothing.
"""

from __future__ import annotations

import functools

import jsonschema

# Formats llguidance 1.9 compiles (others fail with "Unknown format"); `unknown` it ignores.
GRAMMAR_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
)


@functools.cache
def checked_formats() -> frozenset[str]:
    """Formats jsonschema's checker enforces in this environment (some need optional packages)."""
    return frozenset(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)


def classify(name: str) -> str:
    """`grammar`, `runtime` or `annotation`."""
    if name in GRAMMAR_FORMATS:
        return "grammar"
    return "runtime" if name in checked_formats() else "annotation"


def warm_up() -> None:
    """Run every format checker once: some build their parsers on first use (rfc3987's takes
    ~15 ms), which would otherwise land in a request's step."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for name in checker.checkers:
        checker.conforms("x", name)
