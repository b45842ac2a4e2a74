"""Logprobs in OpenAI's shapes, from the worker's `TokenLogprob` entries.

Chat completions: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs,
forced}], "refusal": null}`. Completions: `choices[].logprobs = {tokens, token_logprobs,
top_logprobs, text_offset, forced}`. `forced` (maskwire) marks tokens the grammar forced: they
were not sampled, their logprob is 0. A token that is not valid UTF-8 on its own (part of a
character) is written `bytes:\\xNN...`, as OpenAI does; `bytes` always has its exact bytes.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

from gateway import errors, schemas
from maskwire.v1 import worker_pb2

MAX_TOP_LOGPROBS = 20  # the worker computes this many alternatives per token


def token_text(token: bytes) -> str:
    """A token's text: its UTF-8, or `bytes:` and its escaped bytes when it is not valid alone."""
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)


def _top(entry: worker_pb2.TopLogprob) -> dict[str, Any]:
    return {
        "token": token_text(entry.token),
        "logprob": entry.logprob,
        "bytes": list(entry.token),
    }


def chat_content(entries: Iterable[worker_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    """`logprobs.content` of a chat choice (or chunk) for these tokens."""
    return [
        {
            **_top(e),
            "top_logprobs": [_top(t) for t in e.top_logprobs],
            "forced": e.forced,
        }
        for e in entries
    ]


def chat_logprobs(entries: Iterable[worker_pb2.TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` object."""
    return {"content": chat_content(entries), "refusal": None}


class CompletionLogprobs:
    """The legacy completions shape; `text_offset` counts characters of the choice's text from
    `start` (the echoed prompt's length), a token that ends inside a character adding none."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, entries: Iterable[worker_pb2.TokenLogprob]) -> dict[str, Any]:
        """The logprobs object for these tokens (the next part of the choice)."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
            "forced": [],
        }
        for e in entries:
            out["tokens"].append(token_text(e.token))
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(
                {token_text(t.token): t.logprob for t in e.top_logprobs} or None
            )
            out["text_offset"].append(self.offset)
            out["forced"].append(e.forced)
            self.offset += len(self._decoder.decode(e.token))
        return out

    @staticmethod
    def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
        """One object from the parts `add` returned, in order."""
        merged: dict[str, list[Any]] = {k: [] for k in CompletionLogprobs().add([])}
        for part in parts:
            for k, v in part.items():
                merged[k].extend(v)
        return merged


def chat_request(req: schemas.ChatCompletionRequest) -> tuple[bool, int]:
    """(logprobs on, top_logprobs) of a chat request; 400 naming the field when invalid."""
    if req.logprobs not in (None, True, False):
        raise errors.bad_request("`logprobs` must be a boolean", "logprobs")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise errors.bad_request(
            f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
        )
    if top and not req.logprobs:
        raise errors.bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return bool(req.logprobs), top or 0


def completion_request(req: schemas.CompletionRequest) -> tuple[bool, int]:
    """(logprobs on, top_logprobs) of a completions request: `logprobs` is the count of
    alternatives, 0 for the sampled tokens' logprobs only, null for none."""
    lp = req.logprobs
    if lp is None:
        return False, 0
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise errors.bad_request(
            f"`logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}] (or null)", "logprobs"
        )
    return True, lp
