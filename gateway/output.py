"""One request's generated text read as the answer: reasoning, content and tool-call deltas.

Both chat completions and the Responses API read the worker stream through `Output`, streamed or
merged, so their answers are the same for the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.reasoning import ReasoningSplitter
from gateway.tool_parser import CallDelta, Delta, Merged, OutputParser
from maskwire.v1 import worker_pb2


class Output:
    """Feeds worker messages through the format's parser (behind a reasoning splitter when the
    model thinks) and counts what a response reports: calls and reasoning tokens."""

    def __init__(self, parser: Callable[[], OutputParser], reasoning: bool) -> None:
        inner = parser()
        self.splitter = ReasoningSplitter(inner) if reasoning else None
        self.parser: OutputParser = self.splitter or inner
        self.calls = 0
        self.reasoning_tokens = 0
        self.merged = Merged()
        self.finished = False

    def feed(self, msg: worker_pb2.GenerateResponse) -> list[Delta]:
        """The deltas of one worker message (plus what was held back, on the last one)."""
        if self.splitter is not None and self.splitter.thinking:
            # The token completing `</think>` counts as reasoning, as the grammar gate reads it.
            self.reasoning_tokens += len(msg.token_ids)
        deltas = self._add(self.parser.feed(msg.text))
        if msg.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
            deltas += self.finish()
        return deltas

    def finish(self) -> list[Delta]:
        """What the parser held back (once; nothing after that)."""
        if self.finished:
            return []
        self.finished = True
        return self._add(self.parser.finish())

    def _add(self, deltas: list[Delta]) -> list[Delta]:
        self.calls += sum(1 for d in deltas if isinstance(d, CallDelta) and d.id is not None)
        self.merged.add(deltas)
        return deltas
