"""Reasoning models: the output's thinking section, apart from the answer.

A chat template with a `<think>...</think>` section makes the model think first. The gateway then
asks the grammar service to apply the request's constraint only after `</think>` (the worker's
`reasoning_end_marker`), and splits the output: everything before `</think>` is reasoning, the
rest is the answer (content or tool calls), so text the constraint did not shape is never
returned as content. An opening `<think>` written by the model is dropped.

A prompt that already closes the section (e.g. Qwen3's `enable_thinking: false` renders an empty
`<think></think>`) has no reasoning: the whole output is the answer.
"""

from __future__ import annotations

from gateway.tool_parser import Delta, OutputParser, ReasoningDelta, partial_prefix

OPEN = "<think>"
CLOSE = "</think>"
_WS = " \t\r\n"


def end_marker(template: str, prompt: str) -> str:
    """`</think>` when the output of `prompt` starts with the model's thinking, else ""."""
    if CLOSE not in template or prompt.rstrip(_WS).endswith(CLOSE):
        return ""
    return CLOSE


class ReasoningSplitter:
    """Reasoning until `</think>`, then the answer through `inner` (leading whitespace dropped)."""

    def __init__(self, inner: OutputParser) -> None:
        self.inner = inner
        self.state = "start"  # -> "thinking" -> "answer_start" -> "answer"
        self.buf = ""

    @property
    def thinking(self) -> bool:
        return self.state in ("start", "thinking")

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip(_WS)
            if head.startswith(OPEN):
                self.buf = head[len(OPEN) :]
            elif OPEN.startswith(head):
                return out  # may still become `<think>`
            self.state = "thinking"
        if self.state == "thinking":
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = partial_prefix(self.buf, CLOSE)
                cut = len(self.buf) - keep
                _reasoning(out, self.buf[:cut])
                self.buf = self.buf[cut:]
                return out
            _reasoning(out, self.buf[:i])
            self.buf = self.buf[i + len(CLOSE) :]
            self.state = "answer_start"
        if self.state == "answer_start":
            self.buf = self.buf.lstrip(_WS)
            if not self.buf:
                return out
            self.state = "answer"
        text, self.buf = self.buf, ""
        return out + self.inner.feed(text)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.thinking:  # cut short while thinking: what was held back is reasoning too
            _reasoning(out, self.buf)
            self.buf = ""
            return out
        return self.inner.finish()


def _reasoning(out: list[Delta], text: str) -> None:
    if text:
        out.append(ReasoningDelta(text))
