"""The worker's side of the grammar Session protocol: placement, replay and poison policy.

One bidirectional `Session` stream per grammar-service replica (`grammar_replica.Replica`, the
transport; the messages are built and read by `grammar_codec`). Each request is opened on the
least-loaded live replica: its constraint is compiled with the unary `Compile` RPC (so a long
compile never holds up the stream's steps), then opened on the stream by `grammar_id`.
`step_rows()` sends every replica its rows in parallel and returns one `RowOutcome` per row, in order. When a
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
import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, grammar_pb2
from neuron_worker.config import GrammarSettings
from neuron_worker.grammar_codec import (
    BadStep,
    RowOutcome,
    close_request,
    open_request,
    read_step,
    step_request,
    step_row,
)
from neuron_worker.grammar_replica import GrammarRequest, Replica, ReplicaDown
from neuron_worker.metrics import GRAMMAR_REPLAYS, POISON_REQUESTS

__all__ = ["GrammarClient", "GrammarRequest", "GrammarRow", "RowOutcome"]

log = logging.getLogger(__name__)

# Constraints remembered as poison.
_MAX_POISON = 4096


@dataclass(frozen=True)
class GrammarRow:
    """One request's part of a step: the tokens it sampled since the last one, and with
    speculation its drafts and its room for drafts of forced text."""

    request: GrammarRequest
    new_tokens: Sequence[int]
    drafts: Sequence[int] = ()
    forced_room: int = 0


class GrammarClient:
    """Places requests on replicas and runs each decode step's grammar round trip."""

    def __init__(
        self,
        addresses: Sequence[str],
        fingerprint: common_pb2.TokenizerFingerprint,
        *,
        words_per_row: int,
        settings: GrammarSettings | None = None,
    ) -> None:
        """`settings` (the worker's `--grammar-*` flags): its `compact_masks` lets replicas
        answer large steps with compact mask rows (their `--compact-min-rows` decides which
        steps): fewer bytes on the wire, decoded here; `poison_after`: replica deaths
        attributed to one request before it fails as poison. Its `targets` are the
        resolver's (`update_replicas`), not read here. None: the flags' defaults."""
        settings = settings or GrammarSettings()
        self.tls = settings.tls  # TLS/mTLS to every replica (None: plaintext)
        self.replicas = [Replica(a, self.tls) for a in addresses]
        self.fingerprint = fingerprint
        self.words_per_row = words_per_row
        self.step_timeout_s = settings.step_timeout_s
        self.open_timeout_s = settings.open_timeout_s
        self.compact_masks = settings.compact_masks
        self.poison_after = max(1, settings.poison_after)
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
                asyncio.get_running_loop().create_task(replica.send(close_request(req.request_id)))
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
            msg = open_request(
                req.request_id, grammar_id, self.fingerprint, req.options, req.consumed
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
        asyncio.get_running_loop().create_task(replica.send(close_request(req.request_id)))

    # ---------------------------------------------------------------- steps
    async def step(
        self,
        entries: Sequence[tuple[GrammarRequest, Sequence[int]]],
        drafts: Sequence[Sequence[int]] | None = None,
        forced_draft_room: Sequence[int] | None = None,
    ) -> list[RowOutcome]:
        """`step_rows` of (request, new tokens) entries, with `drafts` (one list per entry) and
        `forced_draft_room` (one count per entry) when given."""
        for name, per_entry in (("draft lists", drafts), ("room counts", forced_draft_room)):
            if per_entry is not None and len(per_entry) != len(entries):
                raise ValueError(f"{len(per_entry)} {name} for {len(entries)} entries")
        return await self.step_rows(
            [
                GrammarRow(
                    req,
                    new,
                    drafts[i] if drafts is not None else (),
                    forced_draft_room[i] if forced_draft_room is not None else 0,
                )
                for i, (req, new) in enumerate(entries)
            ]
        )

    async def step_rows(self, rows: Sequence[GrammarRow]) -> list[RowOutcome]:
        """Advance each request by its new tokens and get its next mask row, one outcome per row
        in order. The grammar also checks a row's drafts without consuming them and sends a
        mask row after each one it accepts. A row with `forced_room` that gets forced tokens
        gets up to that many drafts of the bytes forced after them in place of its own
        (`RowOutcome.forced_drafts`).

        On OK rows, the request's `consumed` is extended by the new tokens and the forced ones.
        Rows whose replica broke, or whose state the service lost, are re-opened with their
        tokens replayed and sent once more.
        """
        outcomes: list[RowOutcome | None] = [None] * len(rows)
        retry = await self._step_once(rows, range(len(rows)), outcomes, allow_retry=True)
        reopened: list[int] = []
        for i in retry:
            failure = await self._replay(rows[i].request)
            if failure is None:
                reopened.append(i)
            else:
                outcomes[i] = failure
        if reopened:
            await self._step_once(rows, reopened, outcomes, allow_retry=False)
        return [o if o is not None else RowOutcome(ok=False, error="no answer") for o in outcomes]

    async def _replay(self, req: GrammarRequest) -> RowOutcome | None:
        """Re-open `req` with its consumed tokens (elsewhere when its replica broke). Returns
        the failure, or None."""
        old = req.replica
        if old is not None:
            old.requests.discard(req)
        try:
            await self._open(
                req, exclude=old if old is not None and not old.is_current(req) else None
            )
        except RpcError as e:
            return RowOutcome.failed(e)
        self.replays += 1
        GRAMMAR_REPLAYS.inc()
        log.info(
            "re-opened %s on %s with %d replayed tokens",
            req.request_id,
            req.replica.address if req.replica else "?",
            len(req.consumed),
        )
        return None

    async def _step_once(
        self,
        rows: Sequence[GrammarRow],
        indices: Sequence[int],
        outcomes: list[RowOutcome | None],
        *,
        allow_retry: bool,
    ) -> list[int]:
        """One fan-out/fan-in round. Returns the indices that need a re-open and another try."""
        groups: dict[Replica, list[int]] = {}
        retry: list[int] = []
        for i in indices:
            req = rows[i].request
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
                self._step_replica(rep, rows, idx, outcomes, allow_retry)
                for rep, idx in groups.items()
            )
        )
        for r in results:
            retry.extend(r)
        return sorted(retry)

    async def _step_replica(
        self,
        replica: Replica,
        rows: Sequence[GrammarRow],
        idx: list[int],
        outcomes: list[RowOutcome | None],
        allow_retry: bool,
    ) -> list[int]:
        """Send `replica` its rows and read its answer. Returns the indices to re-open."""
        sent = [
            step_row(
                r.request.request_id, len(r.request.consumed), r.new_tokens, r.drafts, r.forced_room
            )
            for r in (rows[i] for i in idx)
        ]
        step_no = next(self._step_no)
        try:
            fut = await replica.send(step_request(step_no, sent, self.compact_masks))
            result = (await asyncio.wait_for(fut, self.step_timeout_s)).step_result
        except ReplicaDown as e:
            return self._lost(replica, e, rows, idx, outcomes, allow_retry)
        except TimeoutError:
            self._timed_out(replica, step_no, idx, outcomes)
            return []
        try:
            answer = read_step(sent, result, self.words_per_row)
        except BadStep as e:
            replica.mark_broken(RuntimeError(f"step {step_no}: {e}"))
            return idx if allow_retry else []
        lost = set(answer.lost) if allow_retry else set()
        retry: list[int] = []
        for j, (i, outcome) in enumerate(zip(idx, answer.outcomes, strict=True)):
            req = rows[i].request
            if j in lost:
                await self._forget(replica, req, step_no, result.rows[j].status)
                retry.append(i)
                continue
            if outcome.ok:
                req.consumed.extend(rows[i].new_tokens)
                req.consumed.extend(outcome.ff_tokens)
                req.fresh = False
            outcomes[i] = outcome
        return retry

    async def _forget(
        self, replica: Replica, req: GrammarRequest, step_no: int, status: grammar_pb2.RowStatus
    ) -> None:
        """The service lost `req`'s state or holds it out of step (e.g. after a replica change):
        free its copy there; a replay rebuilds it."""
        log.warning(
            "step %d: %s %s on %s; replaying",
            step_no,
            req.request_id,
            grammar_pb2.RowStatus.Name(status),
            replica.address,
        )
        replica.requests.discard(req)
        req.replica = None
        # Free the service's copy first (same stream, so it is applied before the re-open).
        await replica.send(close_request(req.request_id))

    def _timed_out(
        self, replica: Replica, step_no: int, idx: list[int], outcomes: list[RowOutcome | None]
    ) -> None:
        """`replica` did not answer in time: its rows fail, and it is dropped and backed off."""
        message = (
            f"grammar service {replica.address} did not answer step {step_no} within "
            f"{self.step_timeout_s:g}s (--grammar-timeout-s)"
        )
        replica.mark_broken(TimeoutError(message))
        for i in idx:
            outcomes[i] = RowOutcome(
                ok=False, error=message, code=grpc.StatusCode.DEADLINE_EXCEEDED
            )

    def _lost(
        self,
        replica: Replica,
        err: ReplicaDown,
        rows: Sequence[GrammarRow],
        idx: list[int],
        outcomes: list[RowOutcome | None],
        allow_retry: bool,
    ) -> list[int]:
        """`replica` broke while holding these rows: strike the requests in their first step
        (when it died), fail the poisoned ones, return the rest for a re-open."""
        retry = []
        for i in idx:
            req = rows[i].request
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
