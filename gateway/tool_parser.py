"""Turn generated text into content and tool-call deltas, incrementally (for streaming).

Every parser takes text chunks with `feed()` and returns deltas as soon as they are certain;
`finish()` flushes what was held back. The same deltas, merged, give the non-streamed message.
The tool-call formats (`gateway.tool_formats`) assemble these pieces:

* `PlainText`: everything is content.
* `TaggedCallParser`: content, except where a marker opens a call (`<tool_call>{...}</tool_call>`
  in Hermes, `[TOOL_CALLS][...]` in Mistral); text that might start a marker is held back.
* `JsonArrayCallParser`: a JSON array of `{"name", "arguments"}` objects.
* `LeadingCallsParser`: calls when the output starts with `{` (Llama 3's JSON calls, several
  separated by `;`), else content.
* `NamedCallParser`: the whole output is the arguments of one known tool.

Call objects accept `arguments` or `parameters`. Arguments are streamed as raw JSON text pieces,
the way OpenAI streams them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

_WS = " \t\r\n"

IdFactory = Callable[[], str]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    """Text of the model's thinking section (`gateway.reasoning`)."""

    text: str


@dataclass
class CallDelta:
    """A piece of tool call `index`: the first piece has `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ReasoningDelta | CallDelta


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
    """Numbers calls (across all of one output) and turns `_CallObject` progress into deltas."""

    def __init__(self, new_id: IdFactory) -> None:
        self.new_id = new_id
        self.count = 0
        self.announced = False

    def start(self) -> None:
        self.announced = False

    def deltas(self, obj: _CallObject) -> list[Delta]:
        if not self.announced:
            if obj.name is None:
                return []
            self.announced = True
            self.count += 1
            return [CallDelta(self.count - 1, self.new_id(), obj.name, obj.take_args())]
        args = obj.take_args()
        return [CallDelta(self.count - 1, arguments=args)] if args else []


class _Body(Protocol):
    """What follows a call marker: calls, fed one character at a time."""

    @property
    def done(self) -> bool: ...

    @property
    def announced(self) -> bool:
        """Whether a call has been handed out (its text can no longer be given back)."""
        ...

    def push(self, c: str) -> bool:
        """Consume `c`; False when it follows the body's end. Raises _ParseError."""
        ...

    def deltas(self) -> list[Delta]: ...


class ObjectBody:
    """One call object."""

    def __init__(self, emit: _CallEmitter) -> None:
        self.emit = emit
        self.obj = _CallObject()
        self.announced = False
        emit.start()

    @property
    def done(self) -> bool:
        return self.obj.done

    def push(self, c: str) -> bool:
        return self.obj.push(c)

    def deltas(self) -> list[Delta]:
        out = self.emit.deltas(self.obj)
        self.announced = self.announced or self.emit.announced
        return out


class ArrayBody:
    """A JSON array of call objects; anything else where the array should start ends it."""

    def __init__(self, emit: _CallEmitter) -> None:
        self.emit = emit
        self.state = "start"
        self.obj = _CallObject()
        self.out: list[Delta] = []
        self.announced = False

    @property
    def done(self) -> bool:
        return self.state == "end"

    def push(self, c: str) -> bool:
        if self.state == "start":
            if c == "[":
                self.state = "between"
            elif c not in _WS:
                raise _ParseError(c)
        elif self.state == "between":
            if c == "{":
                self.obj = _CallObject()
                self.emit.start()
                self.obj.push(c)
                self.state = "call"
            elif c == "]":
                self.state = "end"
            elif c not in _WS and c != ",":
                raise _ParseError(c)
        elif self.state == "call":
            self.obj.push(c)
            self._collect()
            if self.obj.done:
                self.state = "between"
        else:
            return False
        return True

    def _collect(self) -> None:
        self.out += self.emit.deltas(self.obj)
        self.announced = self.announced or self.emit.announced

    def deltas(self) -> list[Delta]:
        out, self.out = self.out, []
        return out


def partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedCallParser:
    """Content with call segments: `open`, a body (one call object, or an array of them), then
    optionally `close`. A segment that turns out not to be a call is given back as content."""

    def __init__(
        self,
        open: str,
        body: Callable[[_CallEmitter], _Body],
        close: str = "",
        new_id: IdFactory = new_call_id,
    ) -> None:
        self.open = open
        self.close = close
        self.make_body = body
        self.state = "text"
        self.buf = ""
        self.raw: list[str] = []  # text of the current segment, replayed if it is no call
        self.emit = _CallEmitter(new_id)
        self.body: _Body = body(self.emit)

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self.buf += text
        while self.buf:
            if self.state == "text":
                i = self.buf.find(self.open)
                if i < 0:
                    keep = partial_prefix(self.buf, self.open)
                    cut = len(self.buf) - keep
                    _content(out, self.buf[:cut])
                    self.buf = self.buf[cut:]
                    break
                _content(out, self.buf[:i])
                self.buf = self.buf[i + len(self.open) :]
                self.state = "call"
                self.raw = [self.open]
                self.body = self.make_body(self.emit)
            elif self.state == "call":
                self._feed_call(out)
            else:  # "close": optional whitespace then the closing tag
                stripped = self.buf.lstrip(_WS)
                if stripped.startswith(self.close):
                    self.buf = stripped[len(self.close) :]
                    self.state = "text"
                elif self.close.startswith(stripped):
                    break  # wait for more
                else:
                    self.buf = stripped  # no closing tag: carry on with text
                    self.state = "text"
        return out

    def _feed_call(self, out: list[Delta]) -> None:
        buf = self.buf
        i = 0
        try:
            while i < len(buf) and not self.body.done:
                self.body.push(buf[i])
                i += 1
        except _ParseError:
            self.raw.append(buf[: i + 1])
            self.buf = buf[i + 1 :]
            self.state = "text"
            if not self.body.announced:
                _content(out, "".join(self.raw))  # not a call after all: give the text back
            return
        self.raw.append(buf[:i])
        self.buf = buf[i:]
        out += self.body.deltas()
        if self.body.done:
            self.state = "close" if self.close else "text"

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.state == "text":
            _content(out, self.buf)
        elif self.state == "call" and not self.body.announced:
            _content(out, "".join(self.raw) + self.buf)
        self.buf = ""
        return out


class JsonArrayCallParser:
    """`[{"name": ..., "arguments": ...}, ...]`, the whole output (`tool_choice: required`)."""

    def __init__(self, new_id: IdFactory = new_call_id) -> None:
        self.emit = _CallEmitter(new_id)
        self.body = ArrayBody(self.emit)
        self.failed = False

    def feed(self, text: str) -> list[Delta]:
        for c in text:
            if self.failed or self.body.done:
                break
            try:
                self.body.push(c)
            except _ParseError:
                self.failed = True  # constrained output never gets here; keep what was parsed
        return self.body.deltas()

    def finish(self) -> list[Delta]:
        return []


class LeadingCallsParser:
    """Calls if the output starts with `{` (after whitespace), separated by `;`; else content.

    Llama 3's JSON tool calling: a reply is either text or `{"name": ..., "parameters": ...}`.
    """

    def __init__(self, new_id: IdFactory = new_call_id) -> None:
        self.emit = _CallEmitter(new_id)
        self.body: _Body = ObjectBody(self.emit)
        self.state = "start"
        self.head = ""  # leading whitespace, held until the first character decides

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        for i, c in enumerate(text):
            if self.state == "start":
                if c in _WS:
                    self.head += c
                    continue
                if c != "{":
                    self.state = "text"
                    _content(out, self.head + text[i:])
                    return out
                self.state = "call"
            if self.state == "text":
                _content(out, text[i:])
                return out
            if self.state == "between":
                if c in _WS or c == ";":
                    continue
                self.body = ObjectBody(self.emit)
                self.state = "call"
            if self.state == "call":
                try:
                    self.body.push(c)
                except _ParseError:
                    self.state = "end"  # constrained output never gets here
                    break
                if self.body.done:
                    out += self.body.deltas()
                    self.state = "between"
        if self.state == "call":
            out += self.body.deltas()
        return out

    def finish(self) -> list[Delta]:
        return [ContentDelta(self.head)] if self.state == "start" and self.head else []


class NamedCallParser:
    """The whole output is the arguments of tool `name` (named `tool_choice`)."""

    def __init__(self, name: str, new_id: IdFactory = new_call_id) -> None:
        self.name = name
        self.new_id = new_id
        self.started = False

    def feed(self, text: str) -> list[Delta]:
        if self.started:
            return [CallDelta(0, arguments=text)] if text else []
        if not text:
            return []
        self.started = True
        return [CallDelta(0, self.new_id(), self.name, text)]

    def finish(self) -> list[Delta]:
        if self.started:
            return []
        self.started = True
        return [CallDelta(0, self.new_id(), self.name, "")]


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
    reasoning: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def add(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if isinstance(d, ContentDelta):
                self.content += d.text
            elif isinstance(d, ReasoningDelta):
                self.reasoning += d.text
            elif d.id is not None:
                self.calls.append(ParsedCall(d.id, d.name or "", d.arguments))
            else:
                self.calls[d.index].arguments += d.arguments
