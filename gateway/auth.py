"""API keys on `/v1/*`: `Authorization: Bearer <key>` checked, and in-flight requests capped per key.

With no keys configured the gateway is open (and no per-key cap applies). `/health`, `/ready`,
`/metrics` and `/docs` are never authenticated: probes and scrapers reach them without a key, so
keep the gateway's port off the public internet or put those paths behind your ingress rules.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import errors
from maskwire.config import ConfigError

ENV_VAR = "MASKWIRE_API_KEYS"
PROTECTED_PREFIX = "/v1/"


class KeyConfigError(ConfigError):
    """An unreadable key file or a malformed key."""


def _check_key(key: str, where: str) -> str:
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise KeyConfigError(f"{where}: an API key must be printable ASCII without spaces")
    return key


def load_keys(flags: Sequence[str], files: Sequence[str], env: str | None = None) -> list[str]:
    """Keys from `--api-key` values, `--api-key-file` files (one per line; blank lines and `#`
    comments skipped) and the `MASKWIRE_API_KEYS` environment variable (comma or whitespace
    separated). Duplicates are dropped."""
    keys: list[str] = [_check_key(k, "--api-key") for k in flags if k]
    for name in files:
        try:
            text = Path(name).read_text()
        except OSError as e:
            raise KeyConfigError(f"--api-key-file {name}: {e.strerror or e}") from None
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(_check_key(line, f"--api-key-file {name}:{n}"))
    value = os.environ.get(ENV_VAR, "") if env is None else env
    keys += [_check_key(k, ENV_VAR) for k in value.replace(",", " ").split()]
    return list(dict.fromkeys(keys))


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


KEY_PLACES = "maskwire.key_places"  # ASGI scope entry: the request's `KeyPlaces`
KEY_INDEX = "maskwire.key_index"  # ASGI scope entry: which API key the request gave


class KeyPlaces:
    """The places one admitted request holds in its API key's share: one from admission, `n`
    once its choices are known (each choice holds a worker batch slot of its own)."""

    def __init__(self, keys: ApiKeys, index: int) -> None:
        self._keys = keys
        self._index = index
        self.held = 0
        self._take(1)

    def hold(self, choices: int) -> None:
        """Hold `choices` places in all, or raise 429 when the key has too few left."""
        extra = choices - self.held
        if extra <= 0:
            return
        if self._keys.active.get(self._index, 0) + extra > self._keys.max_per_key:
            if self._keys.on_reject is not None:
                self._keys.on_reject("key_concurrency")
            raise self._keys._overloaded()
        self._take(extra)

    def _take(self, n: int) -> None:
        self._keys.active[self._index] = self._keys.active.get(self._index, 0) + n
        self.held += n

    def release(self) -> None:
        active = self._keys.active
        active[self._index] -= self.held
        self.held = 0
        if not active[self._index]:
            del active[self._index]


class ApiKeys:
    """Authentication and per-key admission for `/v1/*` (pure ASGI: streams keep their slot
    until the last byte is sent)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Iterable[str],
        max_concurrency_per_key: int = 0,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        # Compare fixed-length digests so neither the keys' contents nor their lengths leak
        # through timing.
        self._digests = [_digest(k.encode()) for k in keys]
        self.max_per_key = max_concurrency_per_key
        self.on_reject = on_reject
        self.active: dict[int, int] = {}  # key index -> admitted requests in flight

    def match(self, authorization: bytes) -> int | None:
        """The index of the key in an `Authorization: Bearer` header value, or None."""
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        digest = _digest(token.strip())
        found = None
        for i, d in enumerate(self._digests):  # no early exit: every key is compared
            if hmac.compare_digest(digest, d):
                found = i
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self._digests
            or not scope["path"].startswith(PROTECTED_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        index = self.match(header)
        if index is None:
            await self._refuse(scope, receive, send, "unauthenticated", _unauthorized())
            return
        scope[KEY_INDEX] = index
        if scope["method"] != "POST" or not self.max_per_key:
            await self.app(scope, receive, send)
            return
        if self.active.get(index, 0) >= self.max_per_key:
            await self._refuse(scope, receive, send, "key_concurrency", self._overloaded())
            return
        places = KeyPlaces(self, index)
        scope[KEY_PLACES] = places
        try:
            await self.app(scope, receive, send)
        finally:
            places.release()

    def _overloaded(self) -> errors.APIError:
        return errors.overloaded(
            f"this API key is at its limit of {self.max_per_key} concurrent requests "
            "(a request with `n` choices counts `n`); retry later"
        )

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, reason: str, err: errors.APIError
    ) -> None:
        from starlette.responses import JSONResponse

        if self.on_reject is not None:
            self.on_reject(reason)
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        await JSONResponse(err.body(), status_code=err.status, headers=headers)(
            scope, receive, send
        )


def _unauthorized() -> errors.APIError:
    return errors.APIError(
        401,
        "invalid or missing API key: send `Authorization: Bearer <key>`",
        code="invalid_api_key",
    )
