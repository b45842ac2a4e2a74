"""`Monitor`: one request's output check, enforced through its mask rows.

The grammar enforces a superset of the schema (the layer relaxed what it cannot express); the
monitor closes the gap without ever taking a token back:

* `feed` follows the tokens the request consumed. Checks run as values complete: the value
  against its schema location, an array item against the earlier ones (uniqueItems), a key
  against propertyNames, a member separator against maxProperties. A violation here means a
  token the mask did not allow was sent anyway: the request fails.
* `filter` runs on the request's next mask row: each allowed token that could complete a value
  with checks is tried on a fork of the scanner and masked off when it would complete a violating
  one. End-of-sequence stays allowed only when the whole output validates against the original
  schema, so a request can never finish with an invalid answer. A row left empty is a dead end:
  no continuation keeps the output valid (`constraint could not be satisfied`).

Without run-time keywords (tier 0) only the last step applies: the output is validated when the
grammar says it is complete.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from grammar_service.schema.checks import NodeChecks, OutputChecks
from grammar_service.schema.keywords import canon
from grammar_service.schema.scanner import (
    CONTAINERS,
    KEY,
    KEY_NEXT,
    KEY_OR_END,
    OBJ,
    ROOT,
    STR,
    VALUE,
    VALUE_OR_END,
    Frame,
    Scanner,
)
from maskwire.tokenizer import Tokenizer

_CLOSERS = frozenset(b"]}")
# CPU time the mask filter of one row may spend trying candidate tokens. Past it, the rest stay
# allowed untried: the output is still validated (a violating token then ends the request with
# CONSTRAINT_UNSATISFIABLE), only the steering is cut short. Validating a string against a big
# negated schema costs ~50 µs, and a free string allows ~160 of SmolLM2's closing tokens.
LOOKAHEAD_BUDGET_S = 0.004
_BUDGET_EVERY = 16  # candidates between clock reads


@dataclass(frozen=True)
class TokenClasses:
    """Per tokenizer: every token's bytes, and which tokens can complete something where."""

    token_bytes: list[bytes]
    quote_ids: np.ndarray  # int64 ids of tokens with a `"` byte (inside a string)
    # int64 ids of tokens that, where a value or a key is expected, complete one (`""`, `1,`,
    # `{}`, `true`, `"a":`), or close a container
    starting_ids: np.ndarray
    closers: np.ndarray  # int32 per token: `]` and `}` bytes
    # bool per token: text then one closing `"` at its end, nothing else (no escape, no other
    # quote): inside a string it completes the string and nothing more
    closes_string: np.ndarray
    eos: np.ndarray  # int64 EOS ids
    special: np.ndarray  # bool per token: special (never JSON text)


_CLASSES: dict[bytes, TokenClasses] = {}


def token_classes(tok: Tokenizer) -> TokenClasses:
    """Computed once per tokenizer (about a second for a 128k vocabulary: the service does it at
    start)."""
    key = tok.fingerprint.tokens_sha256
    found = _CLASSES.get(key)
    if found is None:
        data = tok.vocab_bytes
        special = np.array(
            [bool(tok.ll.is_special_token(i)) for i in range(tok.vocab_size)], dtype=bool
        )
        closers = np.array([sum(c in _CLOSERS for c in b) for b in data], dtype=np.int32)
        starting = [i for i, b in enumerate(data) if closers[i] or _completes(b)]
        found = TokenClasses(
            token_bytes=data,
            quote_ids=np.array([i for i, b in enumerate(data) if b'"' in b], dtype=np.int64),
            starting_ids=np.array(starting, dtype=np.int64),
            closers=closers,
            closes_string=np.array(
                [b.endswith(b'"') and b.count(b'"') == 1 and b"\\" not in b for b in data],
                dtype=bool,
            ),
            eos=np.array(tok.eos_token_ids, dtype=np.int64),
            special=special,
        )
        _CLASSES[key] = found
    return found


class _Probe:
    """A scanner handler that only notes whether anything completed."""

    def __init__(self) -> None:
        self.hit = False

    def value_start(self, scanner: Scanner, parent: Frame, kind: str) -> tuple[str, ...]:
        return ()

    def value_end(self, scanner: Scanner, frame: Frame, end: int) -> str | None:
        self.hit = True
        return None

    def key_end(self, scanner: Scanner, obj: Frame, start: int, end: int) -> str | None:
        self.hit = True
        return None

    def member(self, scanner: Scanner, obj: Frame) -> str | None:
        self.hit = True
        return None


def _completes(data: bytes) -> bool:
    """Whether `data`, where an array item or an object key is expected, completes one. (Text
    that is not JSON there is never allowed by the grammar; if it were, the request's scanner
    would lose track and only the final validation would remain.)"""
    for opening in (b"[", b"{"):
        probe = _Probe()
        scanner = Scanner(probe)
        scanner.commit(opening)
        scanner.commit(data)
        if probe.hit:
            return True
    return False


def _bits(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return ((row[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def _clear(row: np.ndarray, ids: np.ndarray) -> None:
    for t in ids.tolist():
        row[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


@dataclass(frozen=True)
class Ahead:
    """The output as it would be after some tokens that are not consumed yet (drafts)."""

    scanner: Scanner | None  # a fork that scanned them (tier 1)
    text: bytes  # the whole output then (tier 0)


class Monitor:
    """The output check of one request (see the module docstring)."""

    def __init__(self, checks: OutputChecks, classes: TokenClasses) -> None:
        self.checks = checks
        self.classes = classes
        self.text = bytearray()  # the output so far (tier 0)
        self.scanner = Scanner(self) if checks.tracked else None
        self._verdict: tuple[int, str | None] = (-1, None)  # (output length, document error)
        self.cut_short = False  # the last filter left candidates untried (LOOKAHEAD_BUDGET_S)
        self._memo_value: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._memo_items: dict[tuple[str, ...], tuple[NodeChecks, ...]] = {}

    @property
    def tracked(self) -> bool:
        """Run-time keywords are checked as values complete (else: validation at the end)."""
        return self.scanner is not None

    def _bytes(self, tokens: list[int]) -> bytes:
        return b"".join(self.classes.token_bytes[t] for t in tokens)

    # ------------------------------------------------------------------ the request's tokens
    def feed(self, tokens: list[int]) -> str | None:
        """Follow consumed tokens; a violation message when one completes a violating value."""
        if self.scanner is None:
            self.text.extend(self._bytes(tokens))
            return None
        return self.scanner.commit(self._bytes(tokens))

    def try_tokens(self, tokens: list[int]) -> str | None:
        """What `feed` would answer, without feeding (for forced tokens)."""
        if self.scanner is None:
            return None
        return self.scanner.fork().trial(self._bytes(tokens))

    def ahead(self, drafts: list[int]) -> list[Ahead]:
        """The output after each leading draft, up to the first one that would complete a
        violating value (its length is how many drafts the check accepts)."""
        out: list[Ahead] = []
        if self.scanner is None:
            text = bytes(self.text)
            for t in drafts:
                text += self.classes.token_bytes[t]
                out.append(Ahead(None, text))
            return out
        fork = self.scanner
        for t in drafts:
            fork = fork.fork()
            if fork.trial(self.classes.token_bytes[t]) is not None:
                break
            out.append(Ahead(fork, b""))
        return out

    def document_error(self, ahead: Ahead | None = None) -> str | None:
        """Why the output so far (or `ahead`) is not a valid answer (None: it is)."""
        if ahead is not None:
            s = ahead.scanner
            return _document_error(
                self.checks, bytes(s.base) + s.tail if s is not None else ahead.text
            )
        out = self.scanner.base if self.scanner is not None else self.text
        if self._verdict[0] != len(out):
            self._verdict = (len(out), _document_error(self.checks, bytes(out)))
        return self._verdict[1]

    # ------------------------------------------------------------------ mask rows
    def filter(self, row: np.ndarray, ahead: Ahead | None = None) -> tuple[bool, int]:
        """Mask off, in `row` (uint32 words), the tokens that would complete a violating value,
        and end-of-sequence unless the output is valid. `ahead`: the row is for the position
        after those drafts. Returns whether the output may end there (the row's `accepting`)
        and how many tokens were masked off."""
        s = self.scanner if ahead is None else ahead.scanner
        masked = 0
        if s is not None and not s.lost and not s.done:
            masked = self._ban_violations(row, s)
        eos = self.classes.eos
        accepting = bool(_bits(row, eos).any())
        if accepting and self.document_error(ahead) is not None:
            _clear(row, eos)
            return False, masked + len(eos)
        return accepting, masked

    def _ban_violations(self, row: np.ndarray, s: Scanner) -> int:
        need = self._closers_needed(s)
        if need is None:
            return 0
        c = self.classes
        top = s.top
        if top.kind in (STR, KEY):
            ids = c.quote_ids
        elif top.kind in (ROOT, *CONTAINERS) and top.state in (
            VALUE,
            VALUE_OR_END,
            KEY_OR_END,
            KEY_NEXT,
        ):
            ids = c.starting_ids
        else:  # inside a number or literal, after a value or a key: few tokens are allowed
            ids = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            ids = ids[ids < len(c.token_bytes)]
        if need:
            ids = ids[c.closers[ids] >= need]
        ids = ids[_bits(row, ids) & ~c.special[ids]]
        if top.kind in (STR, KEY) and not top.esc:
            # Most candidates only close the string: check the string they make, no scanning.
            simple = c.closes_string[ids]
            ids = np.concatenate([ids[simple], ids[~simple]])
            n_simple = int(simple.sum())
        else:
            n_simple = 0
        banned: list[int] = []
        t0 = time.thread_time()
        self.cut_short = False
        for k, t in enumerate(ids.tolist()):
            if k % _BUDGET_EVERY == 0 and k and time.thread_time() - t0 > LOOKAHEAD_BUDGET_S:
                self.cut_short = True
                break
            if k < n_simple:
                bad = self._closing_error(s, c.token_bytes[t]) is not None
            else:
                bad = s.fork().trial(c.token_bytes[t]) is not None
            if bad:
                banned.append(t)
        if banned:
            _clear(row, np.array(banned, dtype=np.int64))
        return len(banned)

    def _closers_needed(self, s: Scanner) -> int | None:
        """The fewest `]`/`}` bytes a token needs to reach a check (None: no check is open)."""
        top = s.top
        expects_value = top.kind in (ROOT, *CONTAINERS) and top.state in (VALUE, VALUE_OR_END)
        if expects_value and (top.kind == ROOT or top.nodes):
            return 0  # a token may start and complete a value with checks (`{}`, `""`, `1,`)
        best: int | None = None
        above = 0
        for f in reversed(s.frames[1:]):
            if f.nodes:
                checks = [self.checks.checks(p) for p in f.nodes]
                container = f.kind in CONTAINERS
                if any(k.items or k.names or k.max_properties is not None for k in checks):
                    best = above if best is None else min(best, above)
                if any(k.value for k in checks):
                    n = above + (1 if container else 0)
                    best = n if best is None else min(best, n)
            if f.kind in CONTAINERS:
                above += 1
        return best

    # ------------------------------------------------------------------ scanner events
    def value_start(self, scanner: Scanner, parent: Frame, kind: str) -> tuple[str, ...]:
        if parent.kind == OBJ:
            return self.checks.child(parent.nodes, parent.key, kind) if parent.nodes else ()
        if parent.kind in CONTAINERS:
            return self.checks.child(parent.nodes, parent.count, kind) if parent.nodes else ()
        return self.checks.start(kind)

    def _closing_error(self, s: Scanner, token: bytes) -> str | None:
        """What the scanner would answer to `token` (text and a closing quote) inside the string
        on top, without scanning it."""
        top, parent = s.frames[-1], s.frames[-2]
        text = s.text(top.start, len(s.base) + len(s.tail)) + token
        if top.kind == KEY:
            return self._key_error(parent, _value(text))
        return self._value_error(top, parent, text)

    def _value_error(self, frame: Frame, parent: Frame, text: bytes) -> str | None:
        """A violation when `frame`, an item or member of `parent`, ends as `text`."""
        checked = self._value_checked(frame.nodes)
        item_checks = self._item_checks(parent.nodes) if parent.kind != OBJ else ()
        if not checked and not item_checks:
            return None
        value = _value(text)
        for ptr in checked:
            err = self.checks.node_error(ptr, value)
            if err:
                return f"{ptr}: {err}"
        return self._item_error(parent, value, item_checks) if item_checks else None

    def value_end(self, scanner: Scanner, frame: Frame, end: int) -> str | None:
        parent = scanner.frames[-1]
        err = self._value_error(frame, parent, scanner.text(frame.start, end))
        if err is None and parent.kind != OBJ and self._item_checks(parent.nodes):
            self._remember_item(scanner, parent, _value(scanner.text(frame.start, end)))
        return err

    def _value_checked(self, nodes: tuple[str, ...]) -> tuple[str, ...]:
        """The locations among `nodes` whose completed value is validated."""
        found = self._memo_value.get(nodes)
        if found is None:
            found = self._memo_value[nodes] = tuple(p for p in nodes if self.checks.checks(p).value)
        return found

    def _item_checks(self, nodes: tuple[str, ...]) -> tuple[NodeChecks, ...]:
        """The item checks (uniqueItems, maxContains) of an array at `nodes`."""
        found = self._memo_items.get(nodes)
        if found is None:
            checks = (self.checks.checks(p) for p in nodes)
            found = self._memo_items[nodes] = tuple(k for k in checks if k.items)
        return found

    def _item_error(self, arr: Frame, value: Any, checks: tuple[NodeChecks, ...]) -> str | None:
        seen, matched = arr.data or (set(), 0)
        if any(k.unique for k in checks) and canon(value) in seen:
            return f"item {arr.count} repeats an earlier item (uniqueItems)"
        for k in checks:
            if k.contains is not None:
                where, most = k.contains
                if matched + (self.checks.node_error(where, value) is None) > most:
                    return f"more than {most} items match 'contains' (maxContains)"
        return None

    def _remember_item(self, scanner: Scanner, arr: Frame, value: Any) -> None:
        """Count a valid item in: its canonical form for uniqueItems, a `contains` match."""
        seen, matched = arr.data or (set(), 0)
        contains = [k.contains for k in self._item_checks(arr.nodes) if k.contains is not None]
        if any(self.checks.node_error(where, value) is None for where, _ in contains):
            matched += 1
        if scanner.tail:  # a trial: leave the shared state alone
            arr.data = (seen | {canon(value)}, matched)
        else:
            seen.add(canon(value))
            arr.data = (seen, matched)

    def key_end(self, scanner: Scanner, obj: Frame, start: int, end: int) -> str | None:
        key = _value(scanner.text(start, end))
        obj.key = key if isinstance(key, str) else ""
        return self._key_error(obj, obj.key)

    def _key_error(self, obj: Frame, key: Any) -> str | None:
        for ptr in obj.nodes:
            names = self.checks.checks(ptr).names
            if names is not None:
                err = self.checks.node_error(names, key)
                if err:
                    return f"property name {key!r} (propertyNames): {err}"
        return None

    def member(self, scanner: Scanner, obj: Frame) -> str | None:
        for ptr in obj.nodes:
            most = self.checks.checks(ptr).max_properties
            if most is not None and obj.count >= most:
                return f"{ptr}: more than {most} properties (maxProperties)"
        return None


def _document_error(checks: OutputChecks, text: bytes) -> str | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return "the output is not complete JSON"
    return checks.document_error(value)


@functools.lru_cache(maxsize=4096)
def _value(text: bytes) -> Any:
    """A completed value (the mask tries many tokens that complete the same one). Callers never
    change it."""
    try:
        return json.loads(text.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        return None
