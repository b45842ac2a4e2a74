"""`format`: how the grammar produces each format the output check enforces.

The output check validates answers with jsonschema's format checker (the formats it knows depend
on the optional packages installed), so the grammar has to produce strings that pass it. Checking
a format only on the output would steer one string at a time, and a string can have a prefix no
completion rescues ("abc" for a json-pointer, "*" for a regex): the answer would run on to its
token limit, or into a dead end. So every format a checker knows is decided here (the tests in
tests/unit/grammar_service/test_formats.py hold each decision to it):

* `native`: llguidance's own format, every string of which passes the checker (sampled and
  probed at its edges: leap days, leap seconds, lengths);
* `pattern`: a regular expression the layer puts in the grammar instead (with a `maxLength` where
  the checker bounds the length): exactly the strings the checker accepts where the format is a
  regular language, else (`exact` False) a subset holding its usual forms (`regex`, `uri-template`,
  `idn-email`, `idn-hostname`: answers pass the check; rarer valid forms are not produced);
* a format some draft's checker knows with another meaning (draft 3's `time`, `color`) has no
  decision, and a schema that uses it is refused (`Refused`).

A name no checker knows is an annotation and constrains nothing (draft 2020-12: `format` asserts
only with the format-assertion vocabulary). In strict mode the schema goes to llguidance as it is,
so only the names llguidance implements (`GRAMMAR_FORMATS`) are accepted there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema

from grammar_service.schema.keywords import child, children
from grammar_service.schema.metaschema import DRAFT_NAMES
from grammar_service.schema.report import Refused

# Formats llguidance 1.9 compiles (others fail with "Unknown format"); `unknown` it ignores.
GRAMMAR_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
)
# jsonschema's hostname (fqdn) and idna bound a name to 253 characters.
_MAX_HOST = 253


@dataclass(frozen=True)
class Steer:
    """How the grammar produces a format: llguidance's `native` one, or a `pattern`."""

    native: str = ""
    pattern: str = ""
    exact: bool = True  # exactly the strings the checker accepts (else a subset of them)
    max_length: int | None = None

    def describe(self, name: str) -> str:
        if self.native:
            return f"'{name}': llguidance's format, at most {self.max_length} characters"
        if self.exact:
            return f"'{name}': as a pattern of exactly the strings the format check accepts"
        return f"'{name}': as a pattern of its usual forms (every answer passes the format check)"


# -- the patterns (written for both Python's `re` and llguidance's Rust-style regex syntax) ------

_DAY31 = "(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
_DAY30 = "(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
_FEB = "02-(?:0[1-9]|1[0-9]|2[0-8])"
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # year 0 is no date in Python
_LEAP = "(?:0[48]|[2468][048]|[13579][26])"  # two digits divisible by 4, 00 excluded
_LEAP_YEAR = f"(?:[0-9]{{2}}{_LEAP}|{_LEAP}00)"
DATE = f"(?:{_YEAR}-(?:{_DAY31}|{_DAY30}|{_FEB})|{_LEAP_YEAR}-02-29)"
# RFC 3339 as rfc3339-validator reads it: no leap second (":60"), `T`/`Z` in either case.
TIME = (
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?"
    "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
DATE_TIME = f"{DATE}[Tt]{TIME}"

JSON_POINTER = "(?:/(?:[^/~]|~[01])*)*"
# jsonschema refuses a digit after a "0" anywhere in the number ("100" too), not only a leading one.
RELATIVE_JSON_POINTER = f"(?:0|[1-9]+0?)(?:#|{JSON_POINTER})"

# RFC 3986 (URIs) and RFC 3987 (IRIs), appendix A of each, rule by rule.
_HEX = "[0-9A-Fa-f]"
_PCT = f"%{_HEX}{{2}}"
_DEC_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"{_DEC_OCTET}(?:\\.{_DEC_OCTET}){{3}}"
_H16 = f"{_HEX}{{1,4}}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"
_IPV6 = (
    "(?:"
    + "|".join(
        [
            f"(?:{_H16}:){{6}}{_LS32}",
            f"::(?:{_H16}:){{5}}{_LS32}",
            f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
            f"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
            f"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
            f"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
            f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
            f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
            f"(?:(?:{_H16}:){{0,6}}{_H16})?::",
        ]
    )
    + ")"
)
_SUB_DELIMS = "!$&'()*+,;="
# IRIs: the characters RFC 3987 adds in the Basic Multilingual Plane only, and IPv6 literals
# uncompressed: rfc3987-syntax (jsonschema's IRI checker without the GPL rfc3987) reads no more.
_UCSCHAR = "\\u00A0-\\uD7FF\\uF900-\\uFDCF\\uFDF0-\\uFFEF"
_IPRIVATE = "\\uE000-\\uF8FF"


def _reference(iri: bool) -> tuple[str, str]:
    """(absolute, reference) patterns: `URI` and `URI-reference`, or `IRI` and `IRI-reference`."""
    unreserved = "A-Za-z0-9\\-._~" + (_UCSCHAR if iri else "")

    def chars(extra: str) -> str:
        return f"(?:[{unreserved}{_SUB_DELIMS}{extra}]|{_PCT})"

    pchar = chars(":@")
    segment = f"{pchar}*"
    segment_nz = f"{pchar}+"
    segment_nz_nc = f"{chars('@')}+"
    query = f"(?:[{unreserved}{_SUB_DELIMS}:@/?{_IPRIVATE if iri else ''}]|{_PCT})*"
    fragment = f"(?:[{unreserved}{_SUB_DELIMS}:@/?]|{_PCT})*"
    future = f"v{_HEX}+\\.[A-Za-z0-9\\-._~{_SUB_DELIMS}:]+"
    ipv6 = f"(?:{_H16}:){{6}}{_LS32}" if iri else _IPV6
    host = f"(?:\\[(?:{ipv6}|{future})\\]|{_IPV4}|{chars('')}*)"
    authority = f"(?:{chars(':')}*@)?{host}(?::[0-9]*)?"
    abempty = f"(?:/{segment})*"
    absolute = f"/(?:{segment_nz}(?:/{segment})*)?"
    rootless = f"{segment_nz}(?:/{segment})*"
    noscheme = f"{segment_nz_nc}(?:/{segment})*"
    tail = f"(?:\\?{query})?(?:#{fragment})?"
    scheme = "[A-Za-z][A-Za-z0-9+\\-.]*"
    uri = f"{scheme}:(?://{authority}{abempty}|{absolute}|{rootless}|){tail}"
    # URI | relative-ref, with what both allow written once (half the grammar for llguidance)
    reference = (
        f"(?:(?:{scheme}:)?(?://{authority}{abempty}|{absolute})?"
        f"|{scheme}:{rootless}|{noscheme}){tail}"
    )
    return uri, reference


URI, URI_REFERENCE = _reference(iri=False)
IRI, IRI_REFERENCE = _reference(iri=True)

# RFC 6570 templates without the extensions uri-template also reads (defaults, `[]`, `%` in
# names); literal text is anything but braces.
_VARNAME = "[A-Za-z0-9_](?:\\.?[A-Za-z0-9_])*"
_VARSPEC = f"{_VARNAME}(?::[1-9][0-9]{{0,2}}|\\*)?"
URI_TEMPLATE = f"(?:[^{{}}]|\\{{[+#./;?&]?{_VARSPEC}(?:,{_VARSPEC})*\\}})*"

# Python regular expressions built of: literals, escapes, `.`, classes (ranges a-z, A-Z, 0-9
# only), one level of groups, one quantifier per atom, anchors and zero-width escapes unquantified.
# The classes of characters are spelt out: llguidance lets an escaped backslash (`\\` in the
# JSON text) through some negated classes that exclude it.
_RE_TEXT = "\\u00A0-\\uD7FF\\uE000-\\uFFFD"
_RE_LITERAL = f"[ !\"#%&',\\-/0-9:;<=>@A-Z_`a-z~{_RE_TEXT}]"
_RE_ESCAPE = "\\\\[\\\\.*+?()\\[\\]{}|^$/dDwWsS]"
_RE_CLASS_ITEM = (
    f"(?:[ !\"#$%'()*+,./0-9:;<=>?@A-Z_`a-z{{}}{_RE_TEXT}]|\\\\[\\\\\\[\\]dDwWs\\-^]|a-z|A-Z|0-9)"
)
_RE_CLASS = f"\\[\\^?{_RE_CLASS_ITEM}+\\]"
_RE_QUANT = "(?:(?:[*+?]|\\{[0-9]{1,3},?\\})\\??)"
_RE_ANCHOR = "(?:[\\^$]|\\\\[bBAZ])"
_RE_ATOM = f"(?:{_RE_LITERAL}|{_RE_ESCAPE}|\\.|{_RE_CLASS})"
_RE_FLAT = f"(?:{_RE_ATOM}{_RE_QUANT}?|{_RE_ANCHOR})*"
_RE_GROUP = f"\\((?:\\?:)?{_RE_FLAT}(?:\\|{_RE_FLAT})*\\)"
_RE_BRANCH = f"(?:(?:{_RE_ATOM}|{_RE_GROUP}){_RE_QUANT}?|{_RE_ANCHOR})*"
REGEX = f"{_RE_BRANCH}(?:\\|{_RE_BRANCH})*"

# Mailbox-like addresses, characters of the Basic Multilingual Plane past ASCII allowed
# (jsonschema only asks for an "@").
_MAIL_CHAR = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~\\-\\u0080-\\uD7FF\\uE000-\\uFFFD]"
_LABEL_CHAR = "[A-Za-z0-9\\u0080-\\uD7FF\\uE000-\\uFFFD]"
IDN_EMAIL = (
    f"{_MAIL_CHAR}+(?:\\.{_MAIL_CHAR}+)*@{_LABEL_CHAR}(?:-?{_LABEL_CHAR})*"
    f"(?:\\.{_LABEL_CHAR}(?:-?{_LABEL_CHAR})*)*"
)
# ASCII names IDNA takes as they are: labels of 1 to 63 letters, digits and hyphens, no hyphen at
# either end nor as both the third and fourth character (IDNA's rule; "xn--" labels are not made).
_A = "[A-Za-z0-9]"
_LDH = "[A-Za-z0-9-]"
_IDN_LABEL = (
    f"{_A}(?:{_A}|{_LDH}{_A}|{_LDH}{_LDH}{_A}|{_LDH}(?:{_A}{_LDH}|-{_A}){_LDH}{{0,58}}{_A})?"
)
IDN_HOSTNAME = f"{_IDN_LABEL}(?:\\.{_IDN_LABEL})*"

# Every format jsonschema's 2020-12 checker may know, by name.
STEERS: dict[str, Steer] = {
    "date": Steer(pattern=DATE),
    "date-time": Steer(pattern=DATE_TIME),
    "time": Steer(pattern=TIME),
    "duration": Steer(native="duration"),
    "email": Steer(native="email", exact=False),
    "idn-email": Steer(pattern=IDN_EMAIL, exact=False),
    "hostname": Steer(native="hostname", max_length=_MAX_HOST),
    "idn-hostname": Steer(pattern=IDN_HOSTNAME, exact=False, max_length=_MAX_HOST),
    "ipv4": Steer(native="ipv4"),
    "ipv6": Steer(native="ipv6", exact=False),
    "uri": Steer(native="uri", exact=False),
    "uri-reference": Steer(pattern=URI_REFERENCE),
    "iri": Steer(pattern=IRI, exact=False),
    "iri-reference": Steer(pattern=IRI_REFERENCE, exact=False),
    "uuid": Steer(native="uuid"),
    "json-pointer": Steer(pattern=JSON_POINTER),
    "relative-json-pointer": Steer(pattern=RELATIVE_JSON_POINTER),
    "uri-template": Steer(pattern=URI_TEMPLATE, exact=False),
    "regex": Steer(pattern=REGEX, exact=False),
}


_CHECKERS = jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers


def checked_formats() -> frozenset[str]:
    """Formats jsonschema's 2020-12 checker enforces in this environment."""
    return frozenset(_CHECKERS)


@functools.cache
def _by_checker() -> dict[Callable[..., Any], Steer]:
    """The decisions keyed by checker function: another draft's name for the same check (draft
    3's `host-name`, `ip-address`) gets the same decision; a different check gets none."""
    return {_CHECKERS[name][0]: steer for name, steer in STEERS.items() if name in _CHECKERS}


@dataclass(frozen=True)
class Formats:
    """The format decisions for one schema's draft."""

    draft: str
    checkers: dict[str, Any]

    def decide(self, name: str, location: str) -> Steer | None:
        """How to steer `name`, or None for an annotation; raises Refused for a format the
        output check would enforce that nothing steers."""
        checker = self.checkers.get(name)
        if checker is None:
            return None
        steer = STEERS.get(name)
        if steer is None or checker[0] is not _CHECKERS.get(name, (None,))[0]:
            steer = _by_checker().get(checker[0])  # another draft's name for the same check
        if steer is None:
            raise Refused(
                "format",
                location,
                f"'{name}' is a format {self.draft}'s checker enforces on the output, and the "
                "grammar cannot produce it: drop it, or use a format of draft 2020-12",
            )
        return steer


def for_schema(schema: Any) -> Formats:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return Formats(DRAFT_NAMES.get(cls, cls.__name__), dict(cls.FORMAT_CHECKER.checkers))


def check_strict(schema: Any, lenient: bool) -> None:
    """Strict mode: raise Refused for a `format` llguidance does not implement (it would refuse
    it too, without saying where), unless its `lenient` option (or the schema's own, in
    `x-guidance`) has it ignore unknown formats."""
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    if lenient or (isinstance(own, dict) and own.get("lenient") is True):
        return
    for ptr, node in _nodes(schema):
        name = node.get("format")
        if isinstance(name, str) and name not in GRAMMAR_FORMATS and name != "unknown":
            raise Refused(
                "format",
                ptr,
                f"llguidance has no format '{name}' (strict mode compiles only "
                f"{', '.join(sorted(GRAMMAR_FORMATS))}); the complete schema mode steers every "
                "format the output check knows",
            )


def _nodes(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        ptr, node = stack.pop()
        if isinstance(node, dict):
            yield ptr, node
            stack.extend(
                (child(ptr, k) if n is None else child(ptr, k, n), sub)
                for k, n, sub in children(node)
            )


def warm_up() -> None:
    """Run every format checker once: some build their parsers on first use (rfc3987's takes
    ~15 ms), which would otherwise land in a request's step."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for name in checker.checkers:
        checker.conforms("x", name)
