"""Incremental, UTF-8-safe detokenization with stop strings that may span chunks.

Token bytes are fed as they are generated. Text is released only when it is complete UTF-8 and
cannot be the beginning of a stop string; once a stop string appears, the text before it is the
last text released and the match is reported.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Delta:
    """Text released by one `feed` call, and the stop string that matched (if any)."""

    text: str
    stop: str | None = None


class Detokenizer:
    """Turns a stream of token ids into text deltas for one request."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet released (might start a stop string)
        self.stopped: str | None = None

    def fresh(self) -> Detokenizer:
        """A new detokenizer with the same tokenizer and stop strings."""
        return Detokenizer(self._token_bytes, self._stop)

    def token_bytes(self, token_id: int) -> bytes:
        """The tokenizer's bytes of one token."""
        return self._token_bytes(token_id)

    def feed(self, token_ids: Sequence[int]) -> Delta:
        """Add tokens; return the text that is now safe to release."""
        if self.stopped is not None:
            return Delta("")
        raw = b"".join(self._token_bytes(t) for t in token_ids)
        self._held += self._decoder.decode(raw)
        return self._release(final=False)

    def flush(self) -> Delta:
        """End of generation: release everything still held (incomplete bytes become U+FFFD)."""
        if self.stopped is not None:
            return Delta("")
        self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> Delta:
        text = self._held
        if self._stop:
            hit = _first_match(text, self._stop)
            if hit is not None:
                index, stop = hit
                self._held = ""
                self.stopped = stop
                return Delta(text[:index], stop)
        if final or not self._stop:
            self._held = ""
            return Delta(text)
        keep = _longest_stop_prefix_suffix(text, self._stop)
        cut = len(text) - keep
        self._held = text[cut:]
        return Delta(text[:cut])


def _first_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string (ties: the longest, then the first listed)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
