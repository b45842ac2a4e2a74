"""Reasoning models: find the end-of-reasoning marker in a request's tokens, by bytes.

The marker may be one special token (`</think>`), or be split over several ordinary tokens, or end
in the middle of a token. The constraint applies from the token *after* the one that completes the
marker; bytes that token carries after the marker are not fed to the grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ReasoningGate:
    """Tracks whether a request's reasoning part has ended."""

    __slots__ = ("_tail", "done", "marker")

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.done = not marker
        self._tail = b""

    def feed(self, tokens: Sequence[int], token_bytes: Callable[[int], bytes]) -> int:
        """Consume tokens while the reasoning part lasts; return how many of `tokens` belong to
        it (all of them when the marker is still open). The rest are for the grammar."""
        if self.done:
            return 0
        keep = len(self.marker) - 1
        for i, tok in enumerate(tokens):
            window = self._tail + token_bytes(tok)
            if self.marker in window:
                self.done = True
                self._tail = b""
                return i + 1
            self._tail = window[-keep:] if keep else b""
        return len(tokens)

    def would_end(self, tokens: Sequence[int], token_bytes: Callable[[int], bytes]) -> int | None:
        """Index of the first token in `tokens` that would complete the marker, without feeding."""
        if self.done:
            return None
        keep = len(self.marker) - 1
        tail = self._tail
        for i, tok in enumerate(tokens):
            window = tail + token_bytes(tok)
            if self.marker in window:
                return i
            tail = window[-keep:] if keep else b""
        return None
