"""Bounding client-supplied text that is echoed back in error messages and details.

An error that quotes its input (a 100 KB regex, a 5 MB model name, a lone surrogate) must stay
small enough for gRPC's metadata limit (the status message travels in a header) and encodable as
UTF-8 (JSON bodies and gRPC strings both are): otherwise the error itself fails and the client
gets a 500 / RESOURCE_EXHAUSTED instead of the real cause.
"""

from __future__ import annotations

ECHO_LIMIT = 256
"""Characters of one echoed value (a model name, a stop string, a pattern) in a message."""

MESSAGE_LIMIT = 4096
"""Characters of a whole error message (which may quote several values or a compiler error)."""

DEFAULT_MAX_PROMPT_BYTES = 1024 * 1024
"""Default of the gateway's and the worker's `--max-prompt-bytes` (UTF-8 bytes of prompt text
accepted for tokenizing): equal, so a prompt through the gateway is refused there first."""


def truncate_echo(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` made valid UTF-8 text and cut to at most `limit` characters.

    Lone surrogates become `\\udXXX` escapes. A cut ends with a marker that says how much was
    left off, and the marker counts towards `limit`. Costs O(limit), whatever `len(text)` is.
    """
    if limit <= 0:
        return ""
    head = _encodable(text[: limit + 1])
    if len(text) <= limit and len(head) <= limit:
        return head
    marker = f"…[{len(text)} chars in all]"
    return (head[: max(limit - len(marker), 0)] + marker)[:limit]


def utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8 (lone surrogates count as the 3 bytes they would take)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _encodable(text: str) -> str:
    """`text` with lone surrogates (from `"\\ud800"` JSON escapes) written as escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def truncate_utf8(text: str, max_bytes: int) -> str:
    """Like `truncate_echo`, but the result's UTF-8 encoding takes at most `max_bytes` (a gRPC
    status travels in headers, which are limited in bytes)."""
    head = _encodable(text[: max_bytes + 1])
    data = head.encode("utf-8")
    if len(text) <= max_bytes and len(data) <= max_bytes:
        return head
    marker = f"…[{len(text)} chars in all]"
    room = max(max_bytes - len(marker.encode("utf-8")), 0)
    return (data[:room].decode("utf-8", "ignore") + marker)[:max_bytes]
