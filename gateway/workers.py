"""gRPC client pool over the workers: health-aware, least-loaded, with failover before output.

Each worker gets one channel. `dns:///NAME:PORT` targets are expanded to every address behind the
name and followed as it changes (`maskwire.discovery`; a Kubernetes headless Service lists one
address per ready pod). A background task checks `grpc.health.v1` every
`health_interval_s` and fetches `GetModelInfo` once a worker is up. A request goes to the healthy
worker with the fewest requests in flight (round robin among ties); if the call fails with
UNAVAILABLE or RESOURCE_EXHAUSTED before any output, the next worker is tried. Worker errors are
mapped to OpenAI-shaped errors with the `google.rpc` details kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import errors
from gateway.config import GatewayConfig
from maskwire import discovery
from maskwire.rpc import RpcError, client_channel_options
from maskwire.tls import make_channel
from maskwire.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Retried on another worker when nothing was streamed yet. Never retried: INVALID_ARGUMENT and
# the rest of the client errors, among them CONSTRAINT_CRASHED (a constraint that crashed the
# grammar tier would crash it again through the next worker).
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# UNAVAILABLE reasons that describe a tier behind the worker, not the worker itself.
_TIER_REASONS = ("GRAMMAR_SERVICE_UNAVAILABLE", "COMPILE_SANDBOX_UNAVAILABLE")


def parse_addresses(values: Sequence[str]) -> list[str]:
    """`--worker a:1,b:2 --worker c:3` -> ["a:1", "b:2", "c:3"] (duplicates dropped)."""
    out: list[str] = []
    for v in values:
        for a in v.split(","):
            a = a.strip()
            if a and a not in out:
                out.append(a)
    return out


@dataclass
class WorkerEndpoint:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    in_flight: int = 0
    info: worker_pb2.ModelInfo | None = None
    last_error: str = field(default="not checked yet")
    retired: bool = False  # no longer behind its DNS name: closed once idle


class WorkerPool:
    """The workers behind the gateway; create and use it inside one event loop."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        resolve: discovery.ResolveFn | None = None,
        on_health: Callable[[str, bool], None] | None = None,
    ) -> None:
        """The workers, their health checks, DNS refresh and TLS as `config` (the gateway's
        flags) gives them."""
        self.tls = config.worker_tls  # TLS/mTLS to every worker (None: plaintext)
        self.addresses = parse_addresses(config.workers)
        if not self.addresses:
            raise ValueError("at least one worker address is needed")
        discovery.parse_targets(self.addresses)  # TargetError now, not at start-up
        self.dns_refresh_s = config.worker_dns_refresh_s
        self._resolve = resolve
        self._resolver: discovery.Resolver | None = None
        self.health_interval_s = config.health_interval_s
        self.health_timeout_s = config.health_timeout_s
        self.on_health = on_health
        self.endpoints: list[WorkerEndpoint] = []
        self._rr = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._checking: asyncio.Future[list[None]] | None = None
        self._pending: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        kw = {"resolve": self._resolve} if self._resolve is not None else {}
        self._resolver = discovery.Resolver(
            self.addresses, refresh_s=self.dns_refresh_s, on_change=self._apply, **kw
        )
        await self._resolver.start()
        await self.check_all()
        self._task = asyncio.create_task(self._monitor(), name="worker-health")

    def _apply(self, change: discovery.Change) -> None:
        """Follow the replica set: new workers are health-checked, gone ones closed when idle."""
        for a in sorted(change.added):
            ch = make_channel(a, self.tls, client_channel_options())
            ep = WorkerEndpoint(
                a, ch, worker_pb2_grpc.WorkerStub(ch), health_pb2_grpc.HealthStub(ch)
            )
            self.endpoints.append(ep)
            if self._task is not None:  # after start-up: check it now rather than next round
                self._background(self._check(ep))
        for ep in [ep for ep in self.endpoints if ep.address in change.removed]:
            self.endpoints.remove(ep)
            ep.healthy = False
            ep.retired = True
            if ep.in_flight == 0:
                self._background(ep.channel.close())

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def refresh(self) -> None:
        """Re-resolve `dns:///` targets now."""
        if self._resolver is not None:
            await self._resolver.refresh()

    async def close(self) -> None:
        if self._resolver is not None:
            await self._resolver.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for ep in self.endpoints:
            await ep.channel.close()

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the monitor die
                log.exception("worker health check failed")

    async def check_all(self) -> None:
        """Check every worker now; concurrent callers share one round of checks."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(
                asyncio.gather(*(self._check(ep) for ep in self.endpoints))
            )
        await asyncio.shield(self._checking)

    async def _check(self, ep: WorkerEndpoint) -> None:
        was = ep.healthy
        try:
            resp = await ep.health.Check(
                health_pb2.HealthCheckRequest(), timeout=self.health_timeout_s
            )
            ok = resp.status == health_pb2.HealthCheckResponse.SERVING
            ep.last_error = "" if ok else "not serving"
            if ok and ep.info is None:
                ep.info = await ep.stub.GetModelInfo(
                    worker_pb2.GetModelInfoRequest(), timeout=self.health_timeout_s
                )
        except grpc.aio.AioRpcError as e:
            ok = False
            ep.last_error = f"{e.code().name}: {e.details()}"
        ep.healthy = ok
        if ok != was:
            log.info("worker %s is %s", ep.address, "healthy" if ok else f"down ({ep.last_error})")
        if self.on_health is not None:
            self.on_health(ep.address, ok)

    def mark_down(self, ep: WorkerEndpoint, reason: str) -> None:
        if ep.healthy:
            log.warning("worker %s marked down: %s", ep.address, reason)
        ep.healthy = False
        ep.last_error = reason
        if self.on_health is not None:
            self.on_health(ep.address, False)

    async def _refresh_if_none_healthy(self) -> None:
        # Workers that came up (or back) since the last round must not wait a full interval.
        if not any(ep.healthy for ep in self.endpoints):
            await self.check_all()

    async def model_info(self) -> worker_pb2.ModelInfo:
        """The served model (from a healthy worker); 503 when none is reachable."""
        await self._refresh_if_none_healthy()
        for ep in self.endpoints:
            if ep.healthy and ep.info is not None:
                return ep.info
        raise errors.no_worker(self._down_message())

    def known_models(self) -> list[str]:
        return sorted({ep.info.model for ep in self.endpoints if ep.info is not None})

    def _down_message(self) -> str:
        states = "; ".join(f"{ep.address}: {ep.last_error or 'down'}" for ep in self.endpoints)
        return f"no worker is available ({states})"

    def _pick(self, tried: set[str]) -> WorkerEndpoint | None:
        candidates = [ep for ep in self.endpoints if ep.healthy and ep.address not in tried]
        if not candidates:
            return None
        low = min(ep.in_flight for ep in candidates)
        best = [ep for ep in candidates if ep.in_flight == low]
        return best[next(self._rr) % len(best)]

    async def generate(
        self,
        request: worker_pb2.GenerateRequest,
        *,
        timeout_s: float,
        constraint_param: str | None = None,
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """Stream one request's output; the gRPC call is cancelled when the consumer stops."""
        await self._refresh_if_none_healthy()
        deadline = time.monotonic() + timeout_s
        tried: set[str] = set()
        last: RpcError | None = None
        while True:
            ep = self._pick(tried)
            if ep is None:
                if last is not None:
                    raise errors.from_rpc(last, constraint_param)
                raise errors.no_worker(self._down_message())
            tried.add(ep.address)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.deadline()
            ep.in_flight += 1
            call = ep.stub.Generate(request, timeout=remaining)
            produced = False
            try:
                async for msg in call:
                    produced = True
                    yield msg
                return
            except grpc.aio.AioRpcError as e:
                err = RpcError.from_call_error(e)
                if not produced and err.code in _FAILOVER_CODES:
                    # The grammar tier being down is not this worker being down.
                    if err.code == grpc.StatusCode.UNAVAILABLE and err.reason not in _TIER_REASONS:
                        self.mark_down(ep, f"UNAVAILABLE: {err.message}")
                    last = err
                    continue
                raise errors.from_rpc(err, constraint_param) from e
            finally:
                ep.in_flight -= 1
                call.cancel()
                if ep.retired and ep.in_flight == 0:
                    self._background(ep.channel.close())
