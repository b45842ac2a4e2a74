"""A schema's regular expressions (`pattern`, `patternProperties`, `format: regex`), matched in
linear time.

The grammar (llguidance) enforces patterns with automata; the output check runs them on the output
with RE2, which has no backtracking either: a search takes time linear in the text whatever the
pattern (`(a+)+c|a+b` included), and releases the GIL while it runs. Python's `re` is never used
on a pattern or a text a client chose.

RE2 lacks a few spellings that JSON Schema (ECMA-262) and llguidance (Rust's regex syntax) accept:
Unicode categories by their long names (`\\p{Letter}`, `\\p{gc=Lu}`, `\\p{Script=Greek}`),
properties it has no table for (`\\p{Alphabetic}`: spelt out as code point ranges from the `regex`
package's tables), `\\uXXXX` / `\\u{X...}` escapes, and `\\s` means Unicode white space there
(ASCII in RE2). `translate` rewrites them in one pass over the pattern. `\\d` and `\\w` are ASCII in
all three.

A pattern RE2 still cannot run (backreferences, lookaround, atomic groups, a program past
`MAX_MEM`) or that is not a pattern raises `PatternError`; `guard` refuses such a schema up front.
llguidance refuses backreferences and lookaround too, so no pattern the grammar enforces is lost.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import re2
import regex

# RE2's memory budget per pattern (its default): the compiled program gets two thirds, the lazily
# built DFA the rest; a bigger program is refused as too large. It bounds the work per byte.
MAX_MEM = 8 << 20

# Unicode general categories by long name (loose: lower case, no `_`, `-` or spaces), as RE2
# names them.
_CATEGORIES = {
    "letter": "L",
    "uppercaseletter": "Lu",
    "lowercaseletter": "Ll",
    "titlecaseletter": "Lt",
    "modifierletter": "Lm",
    "otherletter": "Lo",
    "mark": "M",
    "combiningmark": "M",
    "nonspacingmark": "Mn",
    "spacingmark": "Mc",
    "enclosingmark": "Me",
    "number": "N",
    "decimalnumber": "Nd",
    "digit": "Nd",
    "letternumber": "Nl",
    "othernumber": "No",
    "punctuation": "P",
    "punct": "P",
    "connectorpunctuation": "Pc",
    "dashpunctuation": "Pd",
    "openpunctuation": "Ps",
    "closepunctuation": "Pe",
    "initialpunctuation": "Pi",
    "finalpunctuation": "Pf",
    "otherpunctuation": "Po",
    "symbol": "S",
    "mathsymbol": "Sm",
    "currencysymbol": "Sc",
    "modifiersymbol": "Sk",
    "othersymbol": "So",
    "separator": "Z",
    "spaceseparator": "Zs",
    "lineseparator": "Zl",
    "paragraphseparator": "Zp",
    "other": "C",
    "control": "Cc",
    "cntrl": "Cc",
    "format": "Cf",
    "surrogate": "Cs",
    "privateuse": "Co",
    "any": "Any",
}
_SHORT = {v.lower(): v for v in _CATEGORIES.values()}
_NAME_MAX = 64  # longest `\p{...}` name looked for (keeps the scan linear)
_HEX = frozenset("0123456789abcdefABCDEF")


class PatternError(ValueError):
    """A pattern the output check cannot run in linear time."""

    def __init__(self, pattern: str, reason: str, unsupported: bool) -> None:
        super().__init__(reason)
        self.pattern = pattern
        self.reason = reason
        self.unsupported = unsupported  # valid syntax RE2 cannot run (else: not a valid pattern)


def _loose(name: str) -> str:
    return "".join(c for c in name.lower() if c not in "_- ")


def _re2_name(name: str) -> str:
    """A `\\p{...}` name as RE2 spells it, where it has one."""
    key, eq, value = name.partition("=")
    if eq:
        kind = _loose(key)
        if kind in ("sc", "script"):
            return value
        if kind not in ("gc", "generalcategory"):
            return name
        name = value
    loose = _loose(name)
    return _CATEGORIES.get(loose) or _SHORT.get(loose) or name


@functools.lru_cache(maxsize=256)
def _property(name: str, negated: bool, in_class: bool) -> str:
    """`\\p{name}` (`\\P` when negated) in RE2's syntax: RE2's own property when it has it,
    else the code points the `regex` package's Unicode tables give for it (binary properties
    such as `Alphabetic`, `LC`, `Cn`, loosely spelt scripts); unknown names are left for RE2 to
    refuse."""
    e = "P" if negated else "p"
    short = _re2_name(name)
    if _re2_knows(short):
        return f"\\{e}{{{short}}}"
    ranges = _code_points(name, negated)
    if ranges is None:
        return f"\\{e}{{{name}}}"
    if in_class:
        return ranges
    return f"[{ranges}]" if ranges else "[^\\x00-\\x{10FFFF}]"


def _re2_knows(name: str) -> bool:
    try:
        re2.compile(f"\\p{{{name}}}", _OPTIONS)
    except re2.error:
        return False
    return True


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_ =.-")


@functools.cache
def _every_code_point() -> str:
    """Every code point but the surrogates, in order (the text property tables are read from)."""
    points = np.concatenate([np.arange(0xD800), np.arange(0xE000, 0x110000)]).astype("<u4")
    return points.tobytes().decode("utf-32-le")


def _code_points(name: str, negated: bool) -> str | None:
    """The code points of a Unicode property as RE2 class ranges, or None when the `regex`
    package does not know it. The pattern searched is a fixed one-class repetition (linear)."""
    if not name or not set(name) <= _NAME_CHARS:
        return None
    try:
        runs = regex.compile(f"\\{'P' if negated else 'p'}{{{name}}}+")
    except regex.error:
        return None
    out = []
    for m in runs.finditer(_every_code_point(), concurrent=True):
        lo, hi = (i + 0x800 if i >= 0xD800 else i for i in (m.start(), m.end() - 1))
        out.append(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}")
    return "".join(out)


def _hex_at(p: str, i: int, n: int) -> int | None:
    digits = p[i : i + n]
    return int(digits, 16) if len(digits) == n and all(c in _HEX for c in digits) else None


def _unicode_escape(p: str, i: int) -> tuple[int, int] | None:
    """(code point, characters used) of the `\\u` escape whose `u` is at `i`, or None."""
    if p.startswith("{", i + 1):
        end = p.find("}", i + 2, i + 10)
        digits = p[i + 2 : end] if end > 0 else ""
        if digits and all(c in _HEX for c in digits) and int(digits, 16) <= 0x10FFFF:
            return int(digits, 16), end - i + 1
        return None
    code = _hex_at(p, i + 1, 4)
    if code is None:
        return None
    # A surrogate pair spelt as two escapes is one code point.
    if 0xD800 <= code < 0xDC00 and p.startswith("\\u", i + 5):
        low = _hex_at(p, i + 7, 4)
        if low is not None and 0xDC00 <= low < 0xE000:
            return 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), 11
    return code, 5


def translate(pattern: str) -> str:
    """`pattern` in RE2's syntax (see the module docstring); one pass, linear in its length."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "[" and not in_class:
            # `[` or `[^`, and a `]` right after them, which is a member (RE2): as they are.
            j = i + 1 + pattern.startswith("^", i + 1)
            j += pattern.startswith("]", j)
            out.append(pattern[i:j])
            i, in_class = j, True
            continue
        if c == "[" and in_class and pattern.startswith(":", i + 1):  # [:alpha:]
            end = pattern.find(":]", i + 2, i + 2 + _NAME_MAX)
            if end > 0:
                out.append(pattern[i : end + 2])
                i = end + 2
                continue
        if c == "]" and in_class:
            in_class = False
        if c != "\\" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        e = pattern[i + 1]
        if e in "pP" and pattern.startswith("{", i + 2):
            end = pattern.find("}", i + 3, i + 3 + _NAME_MAX)
            if end > 0:
                out.append(_property(pattern[i + 3 : end], e == "P", in_class))
                i = end + 1
                continue
        elif e in "sS":  # Unicode white space, as in ECMA-262 and llguidance (RE2's: ASCII)
            out.append(_property("White_Space", e == "S", in_class))
            i += 2
            continue
        elif e == "u":
            found = _unicode_escape(pattern, i + 1)
            if found is not None:
                code, used = found
                out.append(f"\\x{{{code:X}}}")
                i += 1 + used
                continue
        out.append(pattern[i : i + 2])
        i += 2
    return "".join(out)


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # RE2 would print the pattern to stderr: a log must not hold it
    options.never_capture = True  # only "is there a match": the DFA alone answers that
    options.max_mem = MAX_MEM
    return options


_OPTIONS = _options()


def _build(pattern: str) -> Any:
    try:
        return re2.compile(translate(pattern).encode("utf-8", "surrogatepass"), _OPTIONS)
    except re2.error as e:
        detail = e.args[0] if e.args else "invalid"
        text = detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)
        what = _unsupported(text)
        raise PatternError(
            pattern, f"{what} is not supported ({text})" if what else text, bool(what)
        ) from None


# RE2's message -> what a valid pattern uses that RE2 cannot run.
_UNSUPPORTED = (
    ("invalid perl operator: (?=", "lookahead"),
    ("invalid perl operator: (?!", "lookahead"),
    ("invalid perl operator: (?<", "lookbehind"),
    ("invalid perl operator: (?>", "an atomic group"),
    ("invalid escape sequence: \\k", "a backreference"),
    ("pattern too large", f"an automaton larger than {MAX_MEM >> 20} MiB"),
)


def _unsupported(reason: str) -> str:
    if reason.startswith("invalid escape sequence: \\") and reason[-1:].isdigit():
        return "a backreference"
    return next((what for text, what in _UNSUPPORTED if text in reason), "")


@functools.lru_cache(maxsize=1024)
def compiled(pattern: str) -> Any:
    """The RE2 program of a schema pattern (`PatternError` when RE2 cannot run it)."""
    return _build(pattern)


def search(pattern: str, text: str) -> bool:
    """Whether `pattern` matches somewhere in `text` (ECMA-262 semantics: unanchored)."""
    return compiled(pattern).search(text.encode("utf-8", "surrogatepass")) is not None


def is_regex(text: str) -> bool:
    """`format: regex`: whether `text` (an output string) is a pattern the check can run. Not
    cached: outputs are many, and compiling is linear in their length."""
    try:
        _build(text)
    except PatternError:
        return False
    return True
