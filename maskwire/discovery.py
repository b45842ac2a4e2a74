"""Find every replica of a service behind a DNS name, and follow the set as DNS changes.

A target is either

* `dns:///NAME:PORT` (also `dns:NAME:PORT`): NAME is resolved every `refresh_s` seconds and every
  address it returns is one replica (a Kubernetes headless Service lists one address per ready
  pod), or
* `HOST:PORT`: one replica, passed through as written (gRPC resolves HOST when it connects). This
  keeps `localhost:50051` one replica even though `localhost` may resolve to both 127.0.0.1 and ::1.

A comma-separated list mixes both. `Resolver` reports the union as a set of `IP:PORT` strings
(`[v6]:PORT` for IPv6) and each change as a `Change` (added, removed, current), to a callback and to
any number of `changes()` async iterators.

Failure policy: a name that authoritatively has no addresses (NXDOMAIN / no data, e.g. a headless
Service with no ready pods) resolves to none; any other resolution failure (DNS unreachable, timeout)
keeps the addresses last seen for that target, so a DNS blip never drops live replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 10.0

ResolveFn = Callable[[str, int], Awaitable[Collection[str]]]
"""Resolve (host, port) to IP address strings; raise `socket.gaierror` on failure."""

ChangeCallback = Callable[["Change"], "Awaitable[None] | None"]

# getaddrinfo errors that mean "this name has no addresses" rather than "DNS did not answer".
_NO_ADDRESS_ERRNOS = frozenset(
    e for e in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None)) if e
)


class TargetError(ValueError):
    """A target string that is not `HOST:PORT` or `dns:///NAME:PORT`."""


@dataclass(frozen=True)
class Target:
    """One parsed target: `resolve` is True for `dns:///` targets."""

    host: str
    port: int
    resolve: bool

    def __str__(self) -> str:
        hostport = format_address(self.host, self.port)
        return f"dns:///{hostport}" if self.resolve else hostport


@dataclass(frozen=True)
class Change:
    """One update of the replica set."""

    added: frozenset[str]
    removed: frozenset[str]
    current: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def format_address(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed (`[::1]:50051`), as gRPC targets expect."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_hostport(text: str, original: str) -> tuple[str, int]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise TargetError(f"bad target {original!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise TargetError(f"bad target {original!r}: expected HOST:PORT")
    if not host:
        raise TargetError(f"bad target {original!r}: empty host")
    try:
        port = int(port_text)
    except ValueError:
        raise TargetError(f"bad target {original!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise TargetError(f"bad target {original!r}: port {port} out of range")
    return host, port


def parse_target(spec: str) -> Target:
    """Parse `HOST:PORT`, `[V6]:PORT`, `dns:///NAME:PORT` or `dns:NAME:PORT`."""
    text = spec.strip()
    resolve = False
    if text.startswith("dns:"):
        resolve = True
        text = text[len("dns:") :]
        if text.startswith("//"):
            authority, slash, rest = text[2:].partition("/")
            if not slash:
                raise TargetError(f"bad target {spec!r}: expected dns:///NAME:PORT")
            if authority:
                # A custom DNS server (`dns://8.8.8.8/name`) is not supported: say so, don't ignore it.
                raise TargetError(f"bad target {spec!r}: a DNS authority is not supported")
            text = rest
    elif "://" in text:
        raise TargetError(f"bad target {spec!r}: only dns:/// targets or HOST:PORT are supported")
    host, port = _split_hostport(text, spec)
    return Target(host, port, resolve)


def parse_targets(specs: str | Sequence[str]) -> list[Target]:
    """Parse a comma-separated string (or a list of them) into targets; at least one."""
    items = [specs] if isinstance(specs, str) else list(specs)
    targets = [parse_target(p) for item in items for p in item.split(",") if p.strip()]
    if not targets:
        raise TargetError("no target given")
    return targets


async def resolve_dns(host: str, port: int) -> list[str]:
    """Default resolver: the system's getaddrinfo, run off the event loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [str(info[4][0]) for info in infos]


def _normalize_ip(text: str) -> str:
    # Drop IPv6 zone ids and canonicalize so the same address never counts twice.
    return str(ipaddress.ip_address(text.split("%", 1)[0]))


class Resolver:
    """Keeps the set of replica addresses for one or more targets up to date.

    Use as `async with Resolver("dns:///grammar:50051", on_change=cb) as r:` (or `start()` /
    `stop()`). `start()` resolves once before returning, so `addresses` is filled (possibly empty)
    and `on_change` has seen the initial set as additions; a background task then re-resolves every
    `refresh_s` seconds. `refresh()` forces one resolution now.
    """

    def __init__(
        self,
        targets: str | Sequence[str],
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        resolve: ResolveFn = resolve_dns,
        on_change: ChangeCallback | None = None,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.targets = parse_targets(targets)
        self.refresh_s = refresh_s
        self._resolve = resolve
        self._on_change = on_change
        self._by_target: dict[Target, frozenset[str]] = {}
        self._current: frozenset[str] = frozenset()
        self._failing: set[Target] = set()
        self._subscribers: list[asyncio.Queue[Change | None]] = []
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._lock = asyncio.Lock()

    @property
    def addresses(self) -> frozenset[str]:
        """The current replica addresses (`IP:PORT`, or `HOST:PORT` for static targets)."""
        return self._current

    @property
    def dynamic(self) -> bool:
        """True when some target needs periodic resolution."""
        return any(t.resolve for t in self.targets)

    async def _resolve_target(self, target: Target) -> frozenset[str]:
        if not target.resolve:
            return frozenset({format_address(target.host, target.port)})
        previous = self._by_target.get(target, frozenset())
        try:
            ips = await self._resolve(target.host, target.port)
        except socket.gaierror as e:
            if e.errno in _NO_ADDRESS_ERRNOS:
                self._note_failure(target, f"has no addresses ({e})")
                return frozenset()
            self._note_failure(target, f"resolution failed ({e}); keeping {len(previous)} known")
            return previous
        except OSError as e:
            self._note_failure(target, f"resolution failed ({e}); keeping {len(previous)} known")
            return previous
        if target in self._failing:
            self._failing.discard(target)
            log.info("%s resolves again", target)
        return frozenset(format_address(_normalize_ip(ip), target.port) for ip in ips)

    def _note_failure(self, target: Target, what: str) -> None:
        # Log once per failure streak, not every refresh.
        if target not in self._failing:
            self._failing.add(target)
            log.warning("%s %s", target, what)

    async def refresh(self) -> Change:
        """Resolve every target now; report and return what changed."""
        async with self._lock:
            for target in self.targets:
                self._by_target[target] = await self._resolve_target(target)
            new = frozenset().union(*self._by_target.values())
            change = Change(new - self._current, self._current - new, new)
            self._current = new
        if change:
            log.info(
                "replicas: +%s -%s (now %d)",
                sorted(change.added),
                sorted(change.removed),
                len(new),
            )
            await self._publish(change)
        return change

    async def _publish(self, change: Change) -> None:
        for queue in self._subscribers:
            queue.put_nowait(change)
        if self._on_change is not None:
            try:
                result = self._on_change(change)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                # A failing consumer must not stop discovery for everyone else.
                log.exception("on_change callback failed")

    async def start(self) -> Change:
        """Resolve once, then keep resolving in the background (only if some target is dns:///)."""
        if self._started:
            raise RuntimeError("resolver already started")
        self._started = True
        first = await self.refresh()
        if not self._current:
            log.warning("no replicas found yet for %s", ", ".join(map(str, self.targets)))
        if self.dynamic:
            self._task = asyncio.create_task(self._loop(), name="maskwire-discovery")
        return first

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("replica refresh failed")

    async def stop(self) -> None:
        """Stop refreshing and end every `changes()` iterator."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for queue in self._subscribers:
            queue.put_nowait(None)

    async def __aenter__(self) -> Resolver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def changes(self) -> AsyncIterator[Change]:
        """Yield the current set (as additions, if any) and then every change, until `stop()`."""
        queue: asyncio.Queue[Change | None] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            if self._current:
                yield Change(self._current, frozenset(), self._current)
            while (change := await queue.get()) is not None:
                yield change
        finally:
            self._subscribers.remove(queue)


def add_refresh_argument(
    parser: argparse._ActionsContainer,  # a parser or one of its argument groups
    flag: str = "--grammar-dns-refresh-s",
    *,
    default: float = DEFAULT_REFRESH_S,
) -> None:
    """Add the refresh-period flag to a service's CLI (seconds between DNS resolutions)."""
    parser.add_argument(
        flag,
        type=float,
        default=default,
        metavar="SECONDS",
        help="how often dns:/// targets are re-resolved to find added or removed replicas "
        f"(default {default:g})",
    )
