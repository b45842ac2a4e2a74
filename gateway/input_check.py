"""Checks every field of a request body shares: how deep its JSON nests, and valid Unicode text.

JSON's `\\ud800` escape (and a UTF-8-encoded surrogate, which `json.loads` lets through) yields a
Python string that cannot be encoded as UTF-8: it would fail later, wherever the text is encoded
(the prompt for the worker, a JSON schema, the error message quoting it), as a 500. Deeply nested
values exhaust Python's recursion limit in whatever walks them (copies, serializers, templates).
Both are checked once, before the body is validated, and refused with a 400 that names the field.
JSON documents sent as text inside a field (a schema as a string, tool-call arguments) get the
same checks when they are parsed (`parse_json_text`), and so do their numbers: `NaN`, `Infinity`
and numbers past a double's range (`1e999`, a 400-digit integer) are no JSON any other service
reads, so they are refused (400 `invalid_number`) there and in schemas sent as objects
(`check_numbers`).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request
from maskwire.text import truncate_echo

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_QUOTE, _BRACKETS = ord('"'), b"[]{}"
_MARKS = np.zeros(256, dtype=bool)  # the bytes that decide nesting: quotes and brackets
_MARKS[[_QUOTE, *_BRACKETS]] = True
_PARAM_NAMES = 3  # a depth error's `param`: the first names of the path (the field, not the leaf)
_LARGEST = int(sys.float_info.max)  # an integer past it has no double: llguidance refuses it
# Integer literals longer than this are out of range whatever their digits (and past 4300 digits
# Python refuses to convert them at all): they parse as infinities, which the walk then names.
_MAX_INT_DIGITS = 400
_LONG_DIGITS = re.compile(rb"[0-9]{309}")  # the shortest integer that can be past _LARGEST

Path = tuple[str | int, ...]


def check_body(raw: bytes, body: Any, max_depth: int) -> None:
    """400 when `body` (parsed from `raw`) nests deeper than `max_depth` or holds a lone surrogate.

    Both are decided at C speed (byte scans, numpy, `json.dumps`); the parsed body is walked in
    Python, to name the field, only when it is refused.
    """
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):  # UTF-16/32: decided on the same text as UTF-8
        raw = raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    deep = raw.count(b"{") + raw.count(b"[") > max_depth and _nesting_depth(raw) > max_depth
    if deep or _unencodable(raw, body):
        check_value(body, (), max_depth)


def _nesting_depth(raw: bytes) -> int:
    """How deep valid UTF-8 JSON `raw` nests. Escaped backslashes, then escaped quotes, are
    dropped, so every quote left opens or closes a string; brackets between them do not count."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    a = np.frombuffer(text, dtype=np.uint8)
    marks = a[_MARKS[a]]
    outside = (np.cumsum(marks == _QUOTE, dtype=np.int64) & 1) == 0
    opens = (marks == ord("[")) | (marks == ord("{"))
    closes = (marks == ord("]")) | (marks == ord("}"))
    steps = (opens & outside).astype(np.int32) - (closes & outside).astype(np.int32)
    return int(np.cumsum(steps).max()) if steps.size else 0


def _unencodable(raw: bytes, body: Any) -> bool:
    """Whether a string or key in `body` holds a lone surrogate. Only JSON's `\\ud...` escapes
    or a surrogate encoded as UTF-8 (ED A0-BF ..) can make one; valid pairs (how `json.dumps`
    writes an emoji) are told apart by encoding the body (nested no deeper than the limit)."""
    if b"\\ud" not in raw and b"\\uD" not in raw and b"\xed" not in raw:
        return False
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_value(value: Any, where: Path, max_depth: int, *, numbers: bool = False) -> None:
    """`check_body` for one parsed value found at `where` (a walk in Python); `numbers`: also
    refuse numbers JSON cannot carry (see the module docstring)."""
    found = _find_problem(value, max_depth, numbers)
    if found is None:
        return
    kind, path = found
    full = (*where, *path)
    if kind == "number":
        name = truncate_echo(_path(full))
        raise APIError(
            400,
            f"`{name}` holds a number JSON cannot carry ({truncate_echo(repr(_leaf(value, path)))}"
            "): NaN, Infinity and numbers beyond a double's range (about 1.8e308) are refused",
            param=name,
            code="invalid_number",
        )
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
    """`json.loads` for a JSON document sent inside a string field, with `check_value`'s checks
    (numbers included). Any JSON value may come back (a scalar too): callers check its type.

    Malformed JSON raises `json.JSONDecodeError` for the caller to report (or tolerate).
    """
    try:
        value = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise bad_request(
            f"`{where}` is nested too deeply to parse (the limit is {max_depth} levels)",
            where,
            code="nesting_too_deep",
        ) from None
    check_value(value, (where,), max_depth, numbers=True)
    return value


def check_numbers(value: Any, where: str, max_depth: int) -> None:
    """400 `invalid_number` naming the path when `value` (parsed from the body) holds a number
    JSON cannot carry. Decided at C speed (`json.dumps`); walked only to name the culprit."""
    try:
        text = json.dumps(value, allow_nan=False).encode()
    except ValueError:  # NaN or an infinity somewhere
        pass
    else:
        if _LONG_DIGITS.search(text) is None:
            return
    check_value(value, (where,), max_depth, numbers=True)


def _parse_int(digits: str) -> int | float:
    if len(digits) > _MAX_INT_DIGITS:
        return -math.inf if digits.startswith("-") else math.inf
    return int(digits)


def _bad_number(value: Any) -> bool:
    if type(value) is float:
        return not math.isfinite(value)
    return type(value) is int and not -_LARGEST <= value <= _LARGEST


def _leaf(root: Any, path: Path) -> Any:
    for part in path:
        root = root[part]
    return root


def has_lone_surrogate(s: str) -> bool:
    return not s.isascii() and _LONE_SURROGATE.search(s) is not None


def _find_problem(root: Any, max_depth: int, numbers: bool = False) -> tuple[str, Path] | None:
    """A container nested past `max_depth` ("depth"), a string or key with a lone surrogate
    ("text" / "key"), or with `numbers` a number JSON cannot carry ("number"), with its path;
    None when there is none.

    Iterative (the walk itself cannot recurse), and lean: strings are checked in place and
    empty containers skipped, so only non-empty containers are kept, each with its parent
    (node n's path is parents[n] followed back to the root, built only for the culprit).
    """
    if type(root) is not dict and type(root) is not list:  # a scalar (JSON text can be one)
        if isinstance(root, str):
            return ("text", ()) if has_lone_surrogate(root) else None
        return ("number", ()) if numbers and _bad_number(root) else None
    parents: list[tuple[int, str | int]] = [(-1, "")]
    stack: list[tuple[Any, int, int]] = [(root, 0, 1)]
    while stack:
        value, node, depth = stack.pop()
        if depth > max_depth:
            return "depth", _unwind(parents, node)
        items = value.items() if type(value) is dict else enumerate(value)
        for key, child in items:
            if type(key) is str and has_lone_surrogate(key):
                return "key", (*_unwind(parents, node), key)
            kind = type(child)
            if kind is str:
                if has_lone_surrogate(child):
                    return "text", (*_unwind(parents, node), key)
            elif (kind is dict or kind is list) and (child or depth >= max_depth):
                parents.append((node, key))
                stack.append((child, len(parents) - 1, depth + 1))
            elif numbers and (kind is float or kind is int) and _bad_number(child):
                return "number", (*_unwind(parents, node), key)
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
