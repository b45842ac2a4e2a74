"""The transport to one grammar-service replica: its channel, its `Session` stream, its health.

Answers on a stream come in the order of the messages, so each message sent gets a future that
the stream's reader resolves with the next answer. A stream that breaks (the replica died, the
connection was lost, a message was never answered) fails every pending future with `ReplicaDown`
and drops the requests placed on it; the replica then backs off (0.5 s doubling to 30 s) before
it takes placements again, and its stream is re-created on demand. Whether a broken call means
the replica process *died* (`ReplicaDown.crashed`: it had accepted the call, sending
`maskwire.rpc.ACCEPTED_METADATA` first, then the connection broke) is what the query-of-death
policy (`grammar_client`) counts.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import grpc

from maskwire.rpc import (
    ACCEPTED_METADATA,
    RpcError,
    client_channel_options,
    has_status_details,
)
from maskwire.tls import ClientTLS, make_channel
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from neuron_worker.metrics import GRAMMAR_REPLICA_DEATHS

log = logging.getLogger(__name__)

# How long a replica whose stream broke stays out of placement (doubles per failure, capped).
_BACKOFF_S = (0.5, 30.0)
# Grammar ids remembered per replica.
_MAX_GRAMMAR_IDS = 4096


class ReplicaDown(Exception):
    """The replica's stream is broken (the message may or may not have been applied).
    `crashed`: the replica process died after accepting the call (not: unreachable, drained)."""

    def __init__(self, message: str, *, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed


def _died(err: BaseException | None) -> bool:
    """Whether a failed call means the peer process went away mid-call: a transport failure,
    not a status the service chose to send (maskwire services always attach rich details)."""
    if not isinstance(err, grpc.aio.AioRpcError):
        return False
    if err.code() not in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    ):
        return False
    return not has_status_details(err.trailing_metadata())


@dataclass(eq=False)
class GrammarRequest:
    """One request's grammar session: what to re-open it with, and what the service consumed."""

    request_id: str
    constraint: common_pb2.Constraint
    options: grammar_pb2.RequestOptions
    consumed: list[int] = field(default_factory=list)
    replica: Replica | None = None
    stream_id: int = -1  # the replica stream it was opened on
    closed: bool = False
    # True from an Open until the replica answers the request's first step.
    fresh: bool = False
    # Replicas that died holding this request's compile, Open or first step.
    crashed: list[str] = field(default_factory=list)
    # How the grammar service enforces the request's JSON schema (from `Opened`), if any.
    report: common_pb2.SchemaReport | None = None

    @functools.cached_property
    def key(self) -> str:
        """Identity of the constraint (what the poison memory and grammar ids are keyed by)."""
        return hashlib.sha256(self.constraint.SerializeToString(deterministic=True)).hexdigest()


class Replica:
    """One grammar-service address and its (re-creatable) Session stream."""

    _stream_ids = itertools.count(1)

    def __init__(self, address: str, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.tls = tls
        self.requests: set[GrammarRequest] = set()
        # Opens sent but not yet answered count towards load, so a burst of concurrent Opens
        # spreads over the replicas instead of all landing on the one that looked idle.
        self.opening = 0
        self.stream_id = 0  # 0: no stream
        # Whether the current stream's call was accepted by the service (it sent its headers).
        self.connected = False
        # Constraint key -> grammar_id compiled on this replica (its compile cache holds them).
        self.grammar_ids: OrderedDict[str, str] = OrderedDict()
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._pending: deque[asyncio.Future[grammar_pb2.SessionResponse]] = deque()
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._down_until = 0.0
        self._failures = 0
        self._closed = False

    @property
    def load(self) -> int:
        return len(self.requests) + self.opening

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def is_current(self, req: GrammarRequest) -> bool:
        """Whether `req` still lives on this replica's current stream."""
        return req.replica is self and req.stream_id == self.stream_id and self._call is not None

    def _stub(self) -> grammar_pb2_grpc.GrammarServiceStub:
        if self._channel is None:
            self._channel = make_channel(self.address, self.tls, client_channel_options())
        return grammar_pb2_grpc.GrammarServiceStub(self._channel)

    def _ensure_stream(self) -> None:
        if self._call is not None:
            return
        self._call = self._stub().Session()
        self.stream_id = next(self._stream_ids)
        self.connected = False
        self._reader = asyncio.create_task(self._read(self._call), name=f"grammar-{self.address}")

    async def compile(
        self, req: GrammarRequest, fingerprint: common_pb2.TokenizerFingerprint, timeout_s: float
    ) -> str:
        """Compile `req`'s constraint here (unary `Compile`, beside the stream) and return its
        grammar_id. Raises RpcError (the service refused it) or ReplicaDown."""
        known = self.grammar_ids.get(req.key)
        if known is not None:
            self.grammar_ids.move_to_end(req.key)
            return known
        if self._closed:
            raise ReplicaDown(f"grammar replica {self.address}: client closed")
        try:
            call = self._stub().Compile(
                grammar_pb2.CompileRequest(constraint=req.constraint, tokenizer=fingerprint),
                timeout=timeout_s,
            )
        except Exception as e:  # channel creation failed (e.g. an unparsable address)
            self._down_until = time.monotonic() + _BACKOFF_S[1]
            raise ReplicaDown(f"grammar replica {self.address}: {e}") from None
        accepted = False
        try:
            accepted = _accepted(await call.initial_metadata())
            resp = await call
        except grpc.aio.AioRpcError as e:
            if has_status_details(e.trailing_metadata()):
                raise RpcError.from_call_error(e) from None  # the service refused it
            raise ReplicaDown(
                f"grammar replica {self.address}: {e.details()}", crashed=accepted and _died(e)
            ) from None
        self.grammar_ids[req.key] = resp.grammar_id
        while len(self.grammar_ids) > _MAX_GRAMMAR_IDS:
            self.grammar_ids.popitem(last=False)
        return str(resp.grammar_id)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        err: BaseException | None = None
        try:
            if _accepted(await call.initial_metadata()) and call is self._call:
                self.connected = True
            async for resp in call:
                if not self._pending:
                    err = RuntimeError("grammar service answered a message that was never sent")
                    break
                fut = self._pending.popleft()
                if not fut.done():
                    fut.set_result(resp)
                self._failures = 0
                if call is self._call:
                    self.connected = True
        except asyncio.CancelledError:
            err = ReplicaDown("stream closed")
        except grpc.aio.AioRpcError as e:
            err = e
        if call is self._call:
            self.mark_broken(err or ReplicaDown("grammar service ended the stream"))

    def mark_broken(self, err: BaseException) -> None:
        """Drop the stream: every request on it is lost and must be re-opened elsewhere."""
        call = self._call
        if call is None:
            return
        self._call = None
        crashed = self.connected and _died(err)
        if crashed:
            held = self.opening > 0 or any(r.fresh for r in self.requests)
            GRAMMAR_REPLICA_DEATHS.labels("true" if held else "false").inc()
        self._failures += 1
        self._down_until = time.monotonic() + min(
            _BACKOFF_S[0] * 2 ** (self._failures - 1), _BACKOFF_S[1]
        )
        detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        log.warning(
            "grammar replica %s %s (%s); %d requests to re-open",
            self.address,
            "died" if crashed else "lost",
            detail,
            len(self.requests),
        )
        self.requests.clear()
        self.grammar_ids.clear()  # a dead replica comes back with an empty compile cache
        pending, self._pending = self._pending, deque()
        for fut in pending:
            if not fut.done():
                fut.set_exception(
                    ReplicaDown(f"grammar replica {self.address}: {detail}", crashed=crashed)
                )
        call.cancel()

    async def send(
        self, msg: grammar_pb2.SessionRequest
    ) -> asyncio.Future[grammar_pb2.SessionResponse]:
        """Write one message; the returned future resolves with its answer (or ReplicaDown)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[grammar_pb2.SessionResponse] = loop.create_future()
        fut.add_done_callback(_consume_exception)
        async with self._write_lock:
            if self._closed:
                fut.set_exception(ReplicaDown(f"grammar replica {self.address}: client closed"))
                return fut
            try:
                self._ensure_stream()
            except Exception as e:  # channel creation failed (e.g. an unparsable address)
                self._down_until = time.monotonic() + _BACKOFF_S[1]
                fut.set_exception(ReplicaDown(f"grammar replica {self.address}: {e}"))
                return fut
            call = self._call
            assert call is not None
            self._pending.append(fut)
            try:
                await call.write(msg)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                if call is self._call:
                    self.mark_broken(e)
                if not fut.done():
                    fut.set_exception(ReplicaDown(f"grammar replica {self.address}: {e}"))
        return fut

    async def aclose(self) -> None:
        self._closed = True
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _consume_exception(fut: asyncio.Future[grammar_pb2.SessionResponse]) -> None:
    if not fut.cancelled():
        fut.exception()


def _accepted(metadata: object) -> bool:
    """Whether a call's initial metadata carries the service's `ACCEPTED_METADATA` header."""
    if not metadata:
        return False
    key, value = ACCEPTED_METADATA[0]
    return any(k == key and v == value for k, v in metadata)  # type: ignore[attr-defined]
