"""An incremental JSON scanner over output bytes: which value is open, and events as values end.

The grammar has already checked that the bytes are JSON, so the scanner only tracks structure: a
stack of open values (frames) and, for each, where it started. A `Handler` hears a value start
(it gives the frame its schema locations), a value end, an object key end and an object member
separator, and may answer a violation, which stops the scan.

`fork()` makes a copy that shares the committed bytes and frames (copied before a change), so
the monitor can try a candidate token without touching the real state.
"""

from __future__ import annotations

from typing import Any, Protocol

# Frame kinds.
ROOT, OBJ, ARR, STR, KEY, NUM, LIT = range(7)
CONTAINERS = (OBJ, ARR)
# Container states: expecting a value (or the end), after a value, expecting a key, a colon.
VALUE, VALUE_OR_END, AFTER, KEY_OR_END, KEY_NEXT, COLON, DONE = range(7)

_WS = frozenset(b" \t\n\r")
_NUMBER = frozenset(b"0123456789+-.eE")
_LITERALS = {ord("t"): "true", ord("f"): "false", ord("n"): "null"}
_KIND = {
    ord("{"): "object",
    ord("["): "array",
    ord('"'): "string",
    ord("t"): "boolean",
    ord("f"): "boolean",
    ord("n"): "null",
    **{c: "number" for c in b"-0123456789"},
}


class Frame:
    """One open value. `nodes`: its schema locations (from the handler); containers count their
    members/items and remember the current key (a literal: the word it spells, `left` bytes to
    go); `data` is the handler's per-value state."""

    __slots__ = ("count", "data", "esc", "key", "kind", "left", "nodes", "start", "state")

    def __init__(self, kind: int, start: int, nodes: tuple[str, ...], state: int = 0) -> None:
        self.kind = kind
        self.start = start
        self.nodes = nodes
        self.state = state
        self.count = 0
        self.key = ""
        self.esc = False
        self.left = 0
        self.data: Any = None

    def copy(self) -> Frame:
        f = Frame(self.kind, self.start, self.nodes, self.state)
        f.count, f.key, f.esc, f.left, f.data = self.count, self.key, self.esc, self.left, self.data
        return f


class Handler(Protocol):
    def value_start(self, scanner: Scanner, parent: Frame, kind: str) -> tuple[str, ...]: ...
    def value_end(self, scanner: Scanner, frame: Frame, end: int) -> str | None: ...
    def key_end(self, scanner: Scanner, obj: Frame, start: int, end: int) -> str | None: ...
    def member(self, scanner: Scanner, obj: Frame) -> str | None: ...


class Scanner:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.base = bytearray()  # committed bytes (shared with forks, which never extend it)
        self.tail = b""  # a fork's trial bytes so far, after `base`
        self.frames: list[Frame] = [Frame(ROOT, 0, (), VALUE)]
        self.owned: list[bool] = [True]
        self.lost = False  # bytes that are not JSON: structure unknown from here on

    def fork(self) -> Scanner:
        s = Scanner.__new__(Scanner)
        s.handler = self.handler
        s.base = self.base
        s.tail = self.tail
        s.frames = list(self.frames)
        s.owned = [False] * len(self.frames)
        s.lost = self.lost
        return s

    @property
    def done(self) -> bool:
        """The top-level value is complete."""
        return len(self.frames) == 1 and self.frames[0].state == DONE

    @property
    def top(self) -> Frame:
        return self.frames[-1]

    def text(self, start: int, end: int) -> bytes:
        n = len(self.base)
        if end <= n:
            return bytes(self.base[start:end])
        return bytes(self.base[start:]) + self.tail[max(start - n, 0) : end - n]

    # ------------------------------------------------------------------ scanning
    def commit(self, data: bytes) -> str | None:
        """Append `data` for good and scan it."""
        at = len(self.base)
        self.base.extend(data)
        return self._scan(data, at)

    def trial(self, data: bytes) -> str | None:
        """Scan `data` after the committed and earlier trial bytes (a fork only)."""
        at = len(self.base) + len(self.tail)
        self.tail += data
        return self._scan(data, at)

    def _mine(self) -> Frame:
        """The top frame, copied first if it is shared with another scanner."""
        if not self.owned[-1]:
            self.frames[-1] = self.frames[-1].copy()
            self.owned[-1] = True
        return self.frames[-1]

    def _push(self, frame: Frame) -> None:
        self.frames.append(frame)
        self.owned.append(True)

    def _pop(self) -> Frame:
        self.owned.pop()
        return self.frames.pop()

    def _scan(self, data: bytes, at: int) -> str | None:
        if self.lost:
            return None
        i = 0
        n = len(data)
        while i < n:
            c = data[i]
            f = self.frames[-1]
            kind = f.kind
            if kind in (STR, KEY):
                if f.esc:
                    f = self._mine()
                    f.esc = False
                elif c == 0x5C:  # backslash
                    f = self._mine()
                    f.esc = True
                elif c == 0x22:  # closing quote
                    err = self._end(at + i + 1)
                    if err:
                        return err
                i += 1
                continue
            if kind == NUM:
                if c in _NUMBER:
                    i += 1
                    continue
                err = self._end(at + i)  # the byte ends the number; scan it again
                if err:
                    return err
                continue
            if kind == LIT:
                if c != ord(f.key[len(f.key) - f.left]):
                    self.lost = True  # not JSON: the grammar never allows it
                    return None
                f = self._mine()
                f.left -= 1
                i += 1
                if f.left == 0:
                    err = self._end(at + i)
                    if err:
                        return err
                continue
            err = self._structural(c, at + i)
            if err:
                return err
            if self.lost:
                return None
            i += 1
        return None

    def _structural(self, c: int, pos: int) -> str | None:
        f = self.frames[-1]
        state = f.state
        if c in _WS:
            return None
        if state in (VALUE, VALUE_OR_END):
            if c == 0x5D and state == VALUE_OR_END:  # `]` of an empty array
                return self._end(pos + 1)
            kind = _KIND.get(c)
            if kind is None:
                self.lost = True
                return None
            nodes = self.handler.value_start(self, f, kind)
            if c == 0x7B:
                self._push(Frame(OBJ, pos, nodes, KEY_OR_END))
            elif c == 0x5B:
                self._push(Frame(ARR, pos, nodes, VALUE_OR_END))
            elif c == 0x22:
                self._push(Frame(STR, pos, nodes))
            elif c in _LITERALS:
                lit = Frame(LIT, pos, nodes)
                lit.key = _LITERALS[c]  # the literal it must spell
                lit.left = len(lit.key) - 1
                self._push(lit)
            else:
                self._push(Frame(NUM, pos, nodes))
            return None
        if state in (KEY_OR_END, KEY_NEXT):
            if c == 0x22:
                self._push(Frame(KEY, pos, ()))
                return None
            if c == 0x7D and state == KEY_OR_END:
                return self._end(pos + 1)
        elif state == COLON:
            if c == 0x3A:
                self._mine().state = VALUE
                return None
        elif state == AFTER:
            if c == 0x2C:  # `,`
                if f.kind == OBJ:
                    err = self.handler.member(self, f)
                    if err:
                        return err
                    self._mine().state = KEY_NEXT
                else:
                    self._mine().state = VALUE
                return None
            if (c == 0x7D and f.kind == OBJ) or (c == 0x5D and f.kind == ARR):
                return self._end(pos + 1)
        self.lost = True
        return None

    def _end(self, end: int) -> str | None:
        """The top frame's value (or key) ends at `end`: pop it and tell the handler."""
        frame = self._pop()
        parent = self._mine()
        if frame.kind == KEY:
            parent.state = COLON
            return self.handler.key_end(self, parent, frame.start, end)
        parent.state = DONE if parent.kind == ROOT else AFTER
        err = self.handler.value_end(self, frame, end)
        parent.count += 1
        return err
