"""Server-sent events as OpenAI streams them: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import StreamingResponse

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


def response(body: Any) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=HEADERS)
