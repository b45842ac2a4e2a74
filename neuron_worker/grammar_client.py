"""The worker's side of the grammar Session protocol.

One bidirectional `Session` stream per grammar-service replica. Each request is opened on the
least-loaded live replica: its constraint is compiled with the unary `Compile` RPC (so a long
compile never holds up the stream's steps), then opened on the stream by `grammar_id`. `step()`
sends every replica its rows in parallel and returns one `RowOutcome` per row, in order. When a
replica's stream breaks, its requests are re-opened on another replica with `replay_tokens` (the
tokens the grammar had consumed) and their rows are sent again, so generation continues. A
replica that does not answer within the per-step deadline fails only the requests it holds, with a
clear error, and is taken out of placement for a while.

Query of death: a replica process that dies while it holds a request's compile, Open or first
step gives that request a strike. A request is re-opened elsewhere after one strike; at
`poison_after` strikes it fails with `CONSTRAINT_CRASHED` and its constraint is never sent again
from this worker, so one hostile constraint cannot walk through the whole grammar tier. Requests
that merely lived on the dead replica are replayed as usual. "Died" means the connection broke
after the replica had accepted the call (it sends `maskwire.rpc.ACCEPTED_METADATA` first); an
unreachable replica, a drain or an error status the service sent itself is no strike.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from maskwire.bitmask import step_masks
from maskwire.rpc import (
    ACCEPTED_METADATA,
    RpcError,
    client_channel_options,
    has_status_details,
)
from maskwire.tls import ClientTLS, make_channel
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from neuron_worker.metrics import GRAMMAR_REPLAYS, GRAMMAR_REPLICA_DEATHS, POISON_REQUESTS

log = logging.getLogger(__name__)

# How long a replica whose stream broke stays out of placement (doubles per failure, capped).
_BACKOFF_S = (0.5, 30.0)
# Constraints remembered as poison, and grammar ids remembered per replica.
_MAX_POISON = 4096
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


@dataclass
class RowOutcome:
    """The grammar's answer for one request in one step."""

    ok: bool
    mask: np.ndarray | None = None  # int32 [mask_rows, W]; None: unconstrained at this position
    ff_tokens: list[int] = field(default_factory=list)
    accepting: bool = False
    finished: bool = False
    accepted_drafts: int = (
        0  # leading drafts the grammar accepts (one mask row each after the first)
    )
    # Drafts of the bytes the grammar forces after `ff_tokens`, checked in place of the row's
    # own drafts (`GrammarClient.step`'s `forced_draft_room`).
    forced_drafts: list[int] = field(default_factory=list)
    # (start, count): forced_drafts[start : start + count] are tokens the grammar forces after
    # the drafts before them, kept without comparing them with a draw.
    forced_jump: tuple[int, int] = (0, 0)
    error: str = ""
    code: grpc.StatusCode = grpc.StatusCode.OK
    reason: str = ""  # google.rpc.ErrorInfo reason of the error

    @classmethod
    def failed(cls, err: RpcError) -> RowOutcome:
        return cls(ok=False, error=err.message, code=err.code, reason=err.reason)

    def status(self) -> RpcError:
        """The error as a gRPC status (for a request that has not streamed anything yet)."""
        return RpcError(self.code, self.error, reason=self.reason)


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


def _row_failure(row: grammar_pb2.RowResult, req: GrammarRequest, new: Sequence[int]) -> RowOutcome:
    """The outcome of a row the service answered with an error: its own status (a grammar that
    rejects a token or passes the parser's limits is INVALID_ARGUMENT, not a server fault)."""
    if row.status == grammar_pb2.ROW_STATUS_DESYNC:
        return RowOutcome(
            ok=False,
            error=f"grammar desync: sent position {len(req.consumed) + len(new)}, service "
            f"expected {row.expected_position}",
            code=grpc.StatusCode.INTERNAL,
        )
    if row.HasField("error"):
        return RowOutcome.failed(RpcError.from_status(row.error))
    return RowOutcome(
        ok=False, error=grammar_pb2.RowStatus.Name(row.status), code=grpc.StatusCode.INTERNAL
    )


# One step row: the request, its new tokens, its draft tokens, its room for forced drafts.
_Entry = tuple[GrammarRequest, Sequence[int], Sequence[int], int]


def _accepted(metadata: object) -> bool:
    """Whether a call's initial metadata carries the service's `ACCEPTED_METADATA` header."""
    if not metadata:
        return False
    key, value = ACCEPTED_METADATA[0]
    return any(k == key and v == value for k, v in metadata)  # type: ignore[attr-defined]


class GrammarClient:
    """Places requests on replicas and runs each decode step's grammar round trip."""

    def __init__(
        self,
        addresses: Sequence[str],
        fingerprint: common_pb2.TokenizerFingerprint,
        *,
        words_per_row: int,
        step_timeout_s: float = 5.0,
        open_timeout_s: float = 30.0,
        tls: ClientTLS | None = None,
        compact_masks: bool = True,
        poison_after: int = 2,
    ) -> None:
        """`compact_masks` lets replicas answer large steps with compact mask rows (their
        `--compact-min-rows` decides which steps): fewer bytes on the wire, decoded here.
        `poison_after`: replica deaths attributed to one request before it fails as poison."""
        self.tls = tls  # TLS/mTLS to every replica (None: plaintext)
        self.replicas = [Replica(a, tls) for a in addresses]
        self.fingerprint = fingerprint
        self.words_per_row = words_per_row
        self.step_timeout_s = step_timeout_s
        self.open_timeout_s = open_timeout_s
        self.compact_masks = compact_masks
        self.poison_after = max(1, poison_after)
        self._step_no = itertools.count(1)
        self.replays = 0  # requests re-opened after a replica failure (for metrics/tests)
        # Constraint key -> the error its requests get (constraints that crashed replicas).
        self._poison: OrderedDict[str, RpcError] = OrderedDict()

    # ---------------------------------------------------------------- replica set
    def update_replicas(self, added: Sequence[str], removed: Sequence[str]) -> None:
        """Follow service discovery: new replicas take placements at once; a removed replica's
        requests are re-opened elsewhere at their next step."""
        known = {r.address for r in self.replicas}
        self.replicas.extend(Replica(a, self.tls) for a in added if a not in known)
        gone = set(removed)
        for replica in [r for r in self.replicas if r.address in gone]:
            self.replicas.remove(replica)
            replica.mark_broken(ReplicaDown("removed from service discovery"))
            asyncio.get_running_loop().create_task(replica.aclose())

    # ---------------------------------------------------------------- placement and open
    def _candidates(self, exclude: Replica | None = None) -> list[Replica]:
        live = [r for r in self.replicas if r is not exclude and r.available()]
        if not live:  # everything is backing off: try them anyway rather than fail outright
            live = [r for r in self.replicas if r is not exclude]
        return sorted(live, key=lambda r: r.load)

    async def open(self, req: GrammarRequest) -> list[str]:
        """Open `req` on the least-loaded replica (replaying `req.consumed`); returns warnings.

        Raises RpcError: the service's own error for a bad constraint (field violations kept),
        INVALID_ARGUMENT `CONSTRAINT_CRASHED` for a constraint that crashed replicas,
        UNAVAILABLE when no replica answers.
        """
        return await self._open(req, exclude=None)

    async def _open(self, req: GrammarRequest, exclude: Replica | None) -> list[str]:
        self._check_poison(req)
        tried: list[str] = []
        why: list[str] = []  # each failure, for the error (a TLS failure must be visible there)
        for replica in self._candidates(exclude):
            tried.append(replica.address)
            replica.opening += 1
            try:
                opened = await self._open_on(replica, req)
            except ReplicaDown as e:
                log.info("open %s on %s failed: %s", req.request_id, replica.address, e)
                why.append(str(e))
                if e.crashed:
                    self._strike(req, replica)  # raises once the request is poison
                continue
            except TimeoutError:
                replica.mark_broken(TimeoutError(f"no answer to Open in {self.open_timeout_s}s"))
                why.append(f"grammar replica {replica.address}: no answer to Open")
                continue
            except asyncio.CancelledError:
                # The caller went away, but the service may still apply the Open: close it on the
                # same stream, after it (an id the stream never opened is answered found=false).
                close = grammar_pb2.Close(request_id=req.request_id)
                asyncio.get_running_loop().create_task(
                    replica.send(grammar_pb2.SessionRequest(close=close))
                )
                raise
            finally:
                replica.opening -= 1
            if opened.HasField("error"):
                raise RpcError.from_status(opened.error)
            if opened.position != len(req.consumed):
                raise RpcError(
                    grpc.StatusCode.INTERNAL,
                    f"grammar service replayed {opened.position} of {len(req.consumed)} tokens",
                )
            req.replica = replica
            req.stream_id = replica.stream_id
            req.closed = False
            req.fresh = True
            if opened.HasField("schema_report"):
                req.report = opened.schema_report
            replica.requests.add(req)
            return list(opened.warnings)
        raise RpcError(
            grpc.StatusCode.UNAVAILABLE,
            "no grammar service replica is reachable (tried "
            + (", ".join(tried) or "none")
            + "); constrained requests cannot run until one is back"
            + "".join(f"; {w}" for w in why),
            reason="GRAMMAR_SERVICE_UNAVAILABLE",
        )

    async def _open_on(self, replica: Replica, req: GrammarRequest) -> grammar_pb2.Opened:
        """Compile (unless this replica has the grammar already), then Open by grammar_id; once
        more with a fresh compile if the replica's cache lost the grammar in between."""
        for attempt in (1, 2):
            grammar_id = await replica.compile(req, self.fingerprint, self.open_timeout_s)
            msg = grammar_pb2.SessionRequest(
                open=grammar_pb2.Open(
                    request_id=req.request_id,
                    grammar_id=grammar_id,
                    tokenizer=self.fingerprint,
                    options=req.options,
                    replay_tokens=req.consumed,
                )
            )
            fut = await replica.send(msg)
            opened = (await asyncio.wait_for(fut, self.open_timeout_s)).opened
            if (
                attempt == 1
                and opened.HasField("error")
                and RpcError.from_status(opened.error).reason == "GRAMMAR_NOT_FOUND"
            ):
                replica.grammar_ids.pop(req.key, None)  # evicted there: compile it again
                continue
            return opened
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- query of death
    def _check_poison(self, req: GrammarRequest) -> None:
        err = self._poison.get(req.key)
        if err is not None:
            POISON_REQUESTS.inc()
            raise err

    def _strike(self, req: GrammarRequest, replica: Replica) -> None:
        """`replica` died holding `req`'s compile, Open or first step. Raises the request's
        final error once that has happened `poison_after` times."""
        req.crashed.append(replica.address)
        log.error(
            "grammar replica %s died holding request %s (its compile, Open or first step; "
            "strike %d of %d)",
            replica.address,
            req.request_id,
            len(req.crashed),
            self.poison_after,
        )
        if len(req.crashed) < self.poison_after:
            return
        err = RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"constraint crashed the grammar service: {len(req.crashed)} replicas died while "
            f"compiling it or taking its first step ({', '.join(req.crashed)}); it will not be "
            "sent again",
            [("constraint", "crashed the grammar service")],
            reason="CONSTRAINT_CRASHED",
        )
        self._poison[req.key] = err
        while len(self._poison) > _MAX_POISON:
            self._poison.popitem(last=False)
        POISON_REQUESTS.inc()
        raise err

    def close(self, req: GrammarRequest) -> None:
        """Free the request's grammar state (fire and forget)."""
        if req.closed:
            return
        req.closed = True
        replica = req.replica
        if replica is None or not replica.is_current(req):
            return
        replica.requests.discard(req)
        msg = grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id=req.request_id))
        asyncio.get_running_loop().create_task(replica.send(msg))

    # ---------------------------------------------------------------- steps
    async def step(
        self,
        entries: Sequence[tuple[GrammarRequest, Sequence[int]]],
        drafts: Sequence[Sequence[int]] | None = None,
        forced_draft_room: Sequence[int] | None = None,
    ) -> list[RowOutcome]:
        """Advance each request by its new tokens and get its next mask row; with `drafts` (one
        list per entry), the grammar also checks those tokens without consuming them and sends
        a mask row after each one it accepts. With `forced_draft_room` (one count per entry), a
        row that gets forced tokens gets up to that many drafts of the bytes forced after them
        in place of its own (`RowOutcome.forced_drafts`).

        On OK rows, `req.consumed` is extended by the new tokens and the forced ones.
        """
        for name, per_entry in (("draft lists", drafts), ("room counts", forced_draft_room)):
            if per_entry is not None and len(per_entry) != len(entries):
                raise ValueError(f"{len(per_entry)} {name} for {len(entries)} entries")
        rows: list[_Entry] = [
            (
                req,
                new,
                drafts[i] if drafts is not None else (),
                forced_draft_room[i] if forced_draft_room is not None else 0,
            )
            for i, (req, new) in enumerate(entries)
        ]
        return await self._step(rows)

    async def _step(self, entries: Sequence[_Entry]) -> list[RowOutcome]:
        outcomes: list[RowOutcome | None] = [None] * len(entries)
        retry = await self._step_once(entries, range(len(entries)), outcomes, allow_retry=True)
        if retry:
            reopened: list[int] = []
            for i in retry:
                req = entries[i][0]
                old = req.replica
                if old is not None:
                    old.requests.discard(req)
                try:
                    await self._open(
                        req, exclude=old if old is not None and not old.is_current(req) else None
                    )
                except RpcError as e:
                    outcomes[i] = RowOutcome.failed(e)
                    continue
                self.replays += 1
                GRAMMAR_REPLAYS.inc()
                log.info(
                    "re-opened %s on %s with %d replayed tokens",
                    req.request_id,
                    req.replica.address if req.replica else "?",
                    len(req.consumed),
                )
                reopened.append(i)
            if reopened:
                await self._step_once(entries, reopened, outcomes, allow_retry=False)
        return [o if o is not None else RowOutcome(ok=False, error="no answer") for o in outcomes]

    async def _step_once(
        self,
        entries: Sequence[_Entry],
        indices: Sequence[int],
        outcomes: list[RowOutcome | None],
        *,
        allow_retry: bool,
    ) -> list[int]:
        """One fan-out/fan-in round. Returns the indices that need a re-open and another try."""
        groups: dict[Replica, list[int]] = {}
        retry: list[int] = []
        for i in indices:
            req = entries[i][0]
            if req.replica is not None and req.replica.is_current(req):
                groups.setdefault(req.replica, []).append(i)
            elif allow_retry:
                retry.append(i)
            else:
                outcomes[i] = RowOutcome(
                    ok=False,
                    error="grammar state lost twice in one step",
                    code=grpc.StatusCode.UNAVAILABLE,
                )
        results = await asyncio.gather(
            *(
                self._step_replica(rep, entries, idx, outcomes, allow_retry)
                for rep, idx in groups.items()
            )
        )
        for r in results:
            retry.extend(r)
        return sorted(retry)

    async def _step_replica(
        self,
        replica: Replica,
        entries: Sequence[_Entry],
        idx: list[int],
        outcomes: list[RowOutcome | None],
        allow_retry: bool,
    ) -> list[int]:
        rows = []
        for i in idx:
            req, new, drafts, forced_room = entries[i]
            rows.append(
                grammar_pb2.StepRow(
                    request_id=req.request_id,
                    new_tokens=new,
                    position=len(req.consumed) + len(new),
                    draft_tokens=drafts,
                    forced_draft_room=forced_room,
                )
            )
        step_no = next(self._step_no)
        msg = grammar_pb2.SessionRequest(
            step=grammar_pb2.Step(step=step_no, rows=rows, compact_masks=self.compact_masks)
        )
        try:
            fut = await replica.send(msg)
            resp = await asyncio.wait_for(fut, self.step_timeout_s)
        except ReplicaDown as e:
            return self._lost(replica, e, entries, idx, outcomes, allow_retry)
        except TimeoutError:
            msg_text = (
                f"grammar service {replica.address} did not answer step {step_no} within "
                f"{self.step_timeout_s:g}s (--grammar-timeout-s)"
            )
            replica.mark_broken(TimeoutError(msg_text))
            for i in idx:
                outcomes[i] = RowOutcome(
                    ok=False, error=msg_text, code=grpc.StatusCode.DEADLINE_EXCEEDED
                )
            return []
        result = resp.step_result
        if len(result.rows) != len(idx):
            replica.mark_broken(
                RuntimeError(f"step {step_no}: {len(result.rows)} rows for {len(idx)}")
            )
            return idx if allow_retry else []
        try:
            masks = step_masks(result)  # dense: a view of the message bytes, no copy
            if result.words_per_row != self.words_per_row:
                raise ValueError(
                    f"{result.words_per_row} words per mask row, expected {self.words_per_row}"
                )
            if sum(r.mask_rows for r in result.rows) != len(masks):
                raise ValueError(f"rows claim more or fewer than the {len(masks)} mask rows sent")
        except ValueError as e:
            replica.mark_broken(RuntimeError(f"step {step_no}: bad masks: {e}"))
            return idx if allow_retry else []
        offset = 0
        retry: list[int] = []
        for i, row in zip(idx, result.rows, strict=True):
            req, new, _, _ = entries[i]
            n = row.mask_rows
            if row.status == grammar_pb2.ROW_STATUS_OK:
                mask = None
                if n:
                    mask = masks[offset : offset + n]
                    offset += n
                req.consumed.extend(new)
                req.consumed.extend(row.ff_tokens)
                req.fresh = False
                outcomes[i] = RowOutcome(
                    ok=True,
                    mask=mask,
                    ff_tokens=list(row.ff_tokens),
                    accepting=row.accepting,
                    finished=row.finished,
                    accepted_drafts=row.accepted_drafts,
                    forced_drafts=list(row.forced_drafts),
                    forced_jump=(row.forced_jump_start, row.forced_jump_count),
                )
            elif (
                row.status
                in (grammar_pb2.ROW_STATUS_DESYNC, grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST)
                and allow_retry
            ):
                # State lost or out of step (e.g. after a replica change): rebuild it by replay.
                log.warning(
                    "step %d: %s %s on %s; replaying",
                    step_no,
                    req.request_id,
                    grammar_pb2.RowStatus.Name(row.status),
                    replica.address,
                )
                replica.requests.discard(req)
                req.replica = None
                # Free the service's copy first (same stream, so it is applied before the re-open).
                close = grammar_pb2.SessionRequest(
                    close=grammar_pb2.Close(request_id=req.request_id)
                )
                await replica.send(close)
                retry.append(i)
            else:
                outcomes[i] = _row_failure(row, req, new)
        return retry

    def _lost(
        self,
        replica: Replica,
        err: ReplicaDown,
        entries: Sequence[_Entry],
        idx: list[int],
        outcomes: list[RowOutcome | None],
        allow_retry: bool,
    ) -> list[int]:
        """`replica` broke while holding these rows: strike the requests in their first step
        (when it died), fail the poisoned ones, return the rest for a re-open."""
        retry = []
        for i in idx:
            req = entries[i][0]
            try:
                if err.crashed and req.fresh:
                    self._strike(req, replica)
            except RpcError as poison:
                outcomes[i] = RowOutcome.failed(poison)
                continue
            if allow_retry:
                retry.append(i)
            else:
                outcomes[i] = RowOutcome(
                    ok=False,
                    error=f"grammar replica {replica.address} failed again after a re-open",
                    code=grpc.StatusCode.UNAVAILABLE,
                )
        return retry

    async def aclose(self) -> None:
        for r in self.replicas:
            await r.aclose()
