"""Turn generated text into content and tool-call deltas, incrementally (for streaming).

Every parser takes text chunks with `feed()` and returns deltas as soon as they are certain;
`finish()` flushes what was held back. The same deltas, merged, give the non-streamed message.

* `PlainText`: everything is content.
* `HermesToolParser` (`tool_choice: auto`): content, except `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` segments, which become calls; text that might start a tag is held back.
* `JsonArrayCallParser` (`required`): a JSON array of `{"name", "arguments"}` objects.
* `NamedCallParser` (named tool): the whole output is the arguments of one known tool.

Arguments are streamed as raw JSON text pieces, the way OpenAI streams them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from gateway.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_WS = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallDelta:
    """A piece of tool call `index`: the first piece has `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | CallDelta


class OutputParser(Protocol):
    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class PlainText:
    def feed(self, text: str) -> list[Delta]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[Delta]:
        return []


class _ValueScanner:
    """Finds where one JSON value ends in a character stream (assumes well-formed JSON)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escaped = False
        self.scalar = False
        self.done = False

    def push(self, c: str) -> bool:
        """Consume `c` if it belongs to the value; False (not consumed) past a scalar's end."""
        if not self.started:
            self.started = True
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth = 1
            else:
                self.scalar = True
            return True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 0:
                    self.done = True
            return True
        if self.scalar:
            if c in ",}]" or c in _WS:
                self.done = True
                return False
            return True
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        return True


class _ParseError(Exception):
    pass


@dataclass
class _CallObject:
    """One `{"name": "...", "arguments": {...}}` object, fed a character at a time."""

    state: str = "open"
    key_raw: list[str] = field(default_factory=list)
    key_escaped: bool = False
    key: str = ""
    value: _ValueScanner | None = None
    value_raw: list[str] = field(default_factory=list)
    name: str | None = None
    args_seen: bool = False
    args_is_string: bool = False
    args_out: list[str] = field(default_factory=list)  # argument text not yet handed out

    @property
    def done(self) -> bool:
        return self.state == "done"

    def push(self, c: str) -> bool:
        """Consume one character; False when it is not part of the object (it ended before)."""
        st = self.state
        if st == "done":
            return False
        if st == "open":
            if c in _WS:
                return True
            if c != "{":
                raise _ParseError(c)
            self.state = "key"
            return True
        if st == "key":
            if c in _WS or c == ",":
                return True
            if c == "}":
                self.state = "done"
                if not self.args_seen:
                    self.args_seen = True
                    self.args_out.append("{}")
                return True
            if c != '"':
                raise _ParseError(c)
            self.key_raw = []
            self.state = "in_key"
            return True
        if st == "in_key":
            if self.key_escaped:
                self.key_escaped = False
            elif c == "\\":
                self.key_escaped = True
            elif c == '"':
                self.key = json.loads('"' + "".join(self.key_raw) + '"')
                self.state = "colon"
                return True
            self.key_raw.append(c)
            return True
        if st == "colon":
            if c in _WS:
                return True
            if c != ":":
                raise _ParseError(c)
            self.state = "value"
            return True
        if st == "value":
            if c in _WS:
                return True
            self.value = _ValueScanner()
            self.value_raw = []
            self.state = "in_value"
            if self._is_args():
                self.args_seen = True
                self.args_is_string = c == '"'
        # in_value
        assert self.value is not None
        if not self.value.push(c):
            self._end_value()
            return self.push(c)
        if self._is_args() and not self.args_is_string:
            self.args_out.append(c)
        else:
            self.value_raw.append(c)
        if self.value.done:
            self._end_value()
        return True

    def _is_args(self) -> bool:
        return self.key in ("arguments", "parameters")

    def _end_value(self) -> None:
        raw = "".join(self.value_raw)
        if self.key == "name":
            try:
                name = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _ParseError(raw) from e
            self.name = name if isinstance(name, str) else raw
        elif self._is_args() and self.args_is_string:
            # Arguments given as a JSON string that holds JSON: hand out the inner text.
            try:
                self.args_out.append(str(json.loads(raw)))
            except json.JSONDecodeError as e:
                raise _ParseError(raw) from e
        self.value = None
        self.state = "key"

    def take_args(self) -> str:
        out = "".join(self.args_out)
        self.args_out.clear()
        return out


class _CallEmitter:
    """Numbers calls and turns `_CallObject` progress into `CallDelta`s."""

    def __init__(self) -> None:
        self.count = 0
        self.announced = False

    def start(self) -> None:
        self.announced = False

    def deltas(self, obj: _CallObject, final: bool = False) -> list[Delta]:
        if not self.announced:
            if obj.name is None:
                return []
            self.announced = True
            self.count += 1
            return [CallDelta(self.count - 1, new_call_id(), obj.name, obj.take_args())]
        args = obj.take_args()
        return [CallDelta(self.count - 1, arguments=args)] if args else []


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser:
    """Content with `<tool_call>{json}</tool_call>` segments (Hermes / Qwen style)."""

    def __init__(self) -> None:
        self.state = "text"
        self.buf = ""
        self.raw: list[str] = []  # text of the current tag, replayed as content if it is no call
        self.obj = _CallObject()
        self.emit = _CallEmitter()

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self.buf += text
        while self.buf:
            if self.state == "text":
                i = self.buf.find(TOOL_CALL_OPEN)
                if i < 0:
                    keep = _partial_prefix(self.buf, TOOL_CALL_OPEN)
                    head, self.buf = (
                        self.buf[: len(self.buf) - keep],
                        self.buf[len(self.buf) - keep :],
                    )
                    _content(out, head)
                    break
                _content(out, self.buf[:i])
                self.buf = self.buf[i + len(TOOL_CALL_OPEN) :]
                self.state = "call"
                self.raw = [TOOL_CALL_OPEN]
                self.obj = _CallObject()
                self.emit.start()
            elif self.state == "call":
                self._feed_call(out)
            else:  # "close": expect optional whitespace then </tool_call>
                stripped = self.buf.lstrip(_WS)
                if stripped.startswith(TOOL_CALL_CLOSE):
                    self.buf = stripped[len(TOOL_CALL_CLOSE) :]
                    self.state = "text"
                elif TOOL_CALL_CLOSE.startswith(stripped):
                    break  # wait for more
                else:
                    self.buf = stripped  # no closing tag: carry on with text
                    self.state = "text"
        return out

    def _feed_call(self, out: list[Delta]) -> None:
        buf = self.buf
        i = 0
        try:
            while i < len(buf) and not self.obj.done:
                self.obj.push(buf[i])
                i += 1
        except _ParseError:
            self.raw.append(buf[: i + 1])
            self.buf = buf[i + 1 :]
            self.state = "text"
            if not self.emit.announced:
                _content(out, "".join(self.raw))  # not a call after all: give the text back
            return
        self.raw.append(buf[:i])
        self.buf = buf[i:]
        out += self.emit.deltas(self.obj)
        if self.obj.done:
            self.state = "close"

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.state == "text":
            _content(out, self.buf)
        elif self.state == "call" and not self.emit.announced:
            _content(out, "".join(self.raw) + self.buf)
        self.buf = ""
        return out

    @property
    def calls(self) -> int:
        return self.emit.count


class JsonArrayCallParser:
    """`[{"name": ..., "arguments": ...}, ...]`, the output of `tool_choice: required`."""

    def __init__(self) -> None:
        self.state = "start"
        self.obj = _CallObject()
        self.emit = _CallEmitter()

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        i = 0
        while i < len(text):
            c = text[i]
            if self.state == "start":
                if c == "[":
                    self.state = "between"
                elif c not in _WS:
                    self.state = "end"
            elif self.state == "between":
                if c == "{":
                    self.obj = _CallObject()
                    self.emit.start()
                    self.obj.push(c)
                    self.state = "call"
                elif c == "]":
                    self.state = "end"
            elif self.state == "call":
                try:
                    self.obj.push(c)
                except _ParseError:
                    self.state = "end"
                if self.obj.done:
                    out += self.emit.deltas(self.obj)
                    self.state = "between"
            i += 1
            if self.state == "end":
                break
        if self.state == "call":
            out += self.emit.deltas(self.obj)
        return out

    def finish(self) -> list[Delta]:
        return []

    @property
    def calls(self) -> int:
        return self.emit.count


class NamedCallParser:
    """The whole output is the arguments of tool `name` (named `tool_choice`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Delta]:
        if self.started:
            return [CallDelta(0, arguments=text)] if text else []
        if not text:
            return []
        self.started = True
        return [CallDelta(0, new_call_id(), self.name, text)]

    def finish(self) -> list[Delta]:
        if self.started:
            return []
        self.started = True
        return [CallDelta(0, new_call_id(), self.name, "")]

    @property
    def calls(self) -> int:
        return 1 if self.started else 0


def _content(out: list[Delta], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], ContentDelta):
        out[-1].text += text
    else:
        out.append(ContentDelta(text))


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class Merged:
    """All deltas of one output merged: the non-streamed message."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def add(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if isinstance(d, ContentDelta):
                self.content += d.text
            elif d.id is not None:
                self.calls.append(ParsedCall(d.id, d.name or "", d.arguments))
            else:
                self.calls[d.index].arguments += d.arguments
