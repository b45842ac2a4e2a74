"""Checks every field of a request body shares: how deep its JSON nests, and valid Unicode text.

JSON's `\\ud800` escape (and a UTF-8-encoded surrogate, which `json.loads` lets through) yields a
Python string that cannot be encoded as UTF-8: it would fail later, wherever the text is encoded
(the prompt for the worker, a JSON schema, the error message quoting it), as a 500. Deeply nested
values exhaust Python's recursion limit in whatever walks them (copies, serializers, templates).
Both are checked once, before the body is validated, and refused with a 400 that names the field.
JSON documents sent as text inside a field (a schema as a string, tool-call arguments) get the
same checks when they are parsed (`parse_json_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request
from maskwire.text import truncate_echo

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# In the raw body: a `\uD800`-`\uDFFF` escape, or a surrogate encoded as UTF-8 (ED A0-BF ..).
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_PARAM_NAMES = 3  # a depth error's `param`: the first names of the path (the field, not the leaf)

Path = tuple[str | int, ...]


def check_body(raw: bytes, body: Any, max_depth: int) -> None:
    """400 when `body` (parsed from `raw`) nests deeper than `max_depth` or holds a lone surrogate.

    Cheap scans of the raw bytes decide whether the body needs walking at all, so a plain
    request pays two byte counts and one regex search.
    """
    deep = raw.count(b"{") + raw.count(b"[") > max_depth
    utf8 = raw[:2] not in (b"\xff\xfe", b"\xfe\xff") and b"\x00" not in raw[:4]
    text = not utf8 or _SURROGATE_BYTES.search(raw) is not None
    if deep or text:
        check_value(body, (), max_depth, text=text)


def check_value(value: Any, where: Path, max_depth: int, *, text: bool = True) -> None:
    """`check_body` for one parsed value found at `where`."""
    found = _find_problem(value, max_depth, text)
    if found is None:
        return
    kind, path = found
    full = (*where, *path)
    if kind == "depth":
        # The field that holds the deep value: JSON text's own field, or the body's first names.
        field = _path(where) if where else _path(_first_names(full))
        raise APIError(
            400,
            f"`{truncate_echo(field)}` is nested deeper than {max_depth} levels (at "
            f"`{truncate_echo(_path(full))}`); the gateway's --max-json-depth is {max_depth}",
            param=truncate_echo(field),
            code="nesting_too_deep",
        )
    name = truncate_echo(_path(full))
    what = f"the object key at `{name}`" if kind == "key" else f"`{name}`"
    raise APIError(
        400,
        f"{what} holds a lone UTF-16 surrogate (a `\\ud800`-`\\udfff` escape that is not half "
        "of a pair): not valid Unicode text",
        param=name,
        code="invalid_unicode",
    )


def parse_json_text(text: str, where: str, max_depth: int) -> Any:
    """`json.loads` for a JSON document sent inside a string field, with `check_value`'s checks.

    Malformed JSON raises `json.JSONDecodeError` for the caller to report (or tolerate).
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise bad_request(
            f"`{where}` is nested too deeply to parse (the limit is {max_depth} levels)",
            where,
            code="nesting_too_deep",
        ) from None
    check_value(value, (where,), max_depth)
    return value


def has_lone_surrogate(s: str) -> bool:
    return not s.isascii() and _LONE_SURROGATE.search(s) is not None


def _find_problem(root: Any, max_depth: int, text: bool) -> tuple[str, Path] | None:
    """The first container nested past `max_depth` ("depth") or string or key with a lone
    surrogate ("text" / "key"), with its path. Iterative: the walk itself cannot recurse."""
    # Each visited value is (value, its node, its depth); node n's path is parents[n] followed
    # back to the root, so a path is only built for the value that fails.
    parents: list[tuple[int, str | int]] = [(-1, "")]
    stack: list[tuple[Any, int, int]] = [(root, 0, 1)]
    while stack:
        value, node, depth = stack.pop()
        if isinstance(value, str):
            if text and has_lone_surrogate(value):
                return "text", _unwind(parents, node)
            continue
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        if depth > max_depth:
            return "depth", _unwind(parents, node)
        children = []
        for key, child in items:
            if text and isinstance(key, str) and has_lone_surrogate(key):
                parents.append((node, key))
                return "key", _unwind(parents, len(parents) - 1)
            if isinstance(child, (str, dict, list)):
                parents.append((node, key))
                children.append((child, len(parents) - 1, depth + 1))
        stack.extend(reversed(children))  # document order: the first bad field is reported
    return None


def _unwind(parents: list[tuple[int, str | int]], node: int) -> Path:
    parts: list[str | int] = []
    while node > 0:
        node, key = parents[node]
        parts.append(key)
    return tuple(reversed(parts))


def _first_names(path: Path) -> Path:
    """The path's first `_PARAM_NAMES` names (and their indices): `tools[0].function.parameters`."""
    names = 0
    for i, part in enumerate(path):
        if isinstance(part, str):
            names += 1
            if names > _PARAM_NAMES:
                return path[:i]
    return path


def _path(path: Path) -> str:
    """`("messages", 0, "content")` -> `messages[0].content`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def _is_json(request: Request) -> bool:
    """Whether FastAPI will parse this body as JSON (`application/json` or `+json`)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def checked_route(max_depth: int) -> type[APIRoute]:
    """A route class that runs `check_body` on JSON bodies before FastAPI validates them.

    The body is parsed here once; FastAPI reuses that parse (`Request.json()` caches it). A body
    that does not parse is left to FastAPI, which reports it as usual.
    """

    class CheckedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                if request.method in ("POST", "PUT", "PATCH") and _is_json(request):
                    raw = await request.body()
                    try:
                        body = await request.json()
                    except Exception:  # malformed (or nested past the parser): FastAPI's 400/422
                        body = None
                    else:
                        check_body(raw, body, max_depth)
                return await handler(request)

            return checked

    return CheckedRoute
