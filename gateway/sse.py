"""Server-sent events as OpenAI streams them: `data: {json}\n\n` ... `data: [DONE]\n\n` for
completions, `event: TYPE\ndata: {json}\n\n` for the Responses API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

HEADERS = {
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) must pass chunks through instead of buffering the stream.
    "X-Accel-Buffering": "no",
}


def event(payload: dict[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + event(payload)


@dataclass(frozen=True)
class Chunks:
    """The chunks of one streamed response: every one carries the same id, object, created and
    model, and `usage: null` when `stream_options.include_usage` asked for a final usage chunk."""

    rid: str
    obj: str  # "chat.completion.chunk" or "text_completion"
    created: int
    model: str
    include_usage: bool

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self,
        fields: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
    ) -> bytes:
        """A chunk with one choice holding `fields` (a chat `delta` or a `text`)."""
        body = self._envelope(
            [{"index": index, **fields, "logprobs": logprobs, "finish_reason": finish_reason}]
        )
        if self.include_usage:
            body["usage"] = None
        return event(body)

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The extra last chunk that `include_usage` asks for: no choices, usage set."""
        return event({**self._envelope([]), "usage": usage})


class EventStream(StreamingResponse):
    """An SSE response that always runs `cleanup` once it is over, even when the client left
    before the body started (then the body generator never runs its own `finally`)."""

    def __init__(
        self,
        body: AsyncIterable[bytes],
        cleanup: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={**HEADERS, **(headers or {})}
        )
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()
