"""Server-sent events as OpenAI streams them: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable
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


def usage_event(rid: str, obj: str, created: int, model: str, usage: dict[str, Any]) -> bytes:
    """The extra last chunk that `stream_options.include_usage` asks for: no choices, usage set."""
    return event(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage,
        }
    )


class EventStream(StreamingResponse):
    """An SSE response that always runs `cleanup` once it is over, even when the client left
    before the body started (then the body generator never runs its own `finally`)."""

    def __init__(self, body: AsyncIterable[bytes], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=HEADERS)
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()
