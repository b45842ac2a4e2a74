"""The step loop: continuous batching with the grammar round trip hidden behind the forward pass.

One decode step, for the running requests (each holds the token it sampled last, `pending`):

    send Step(pending tokens) to the grammar replicas     (asyncio, event loop)
    forward(pending tokens) on the device                 (device thread, overlaps the round trip)
    await the masks                                       (only now)
    jump-forward rows: forward(ff tokens) in one pass     (T > 1 rows)
    reorder + unpack + mask + sample                      (device thread, compiled sampler)
    append, detokenize, stop checks, stream deltas        (event loop)

With `--speculative ngram`, a step where some request has draft tokens that the speculation gate
finds worth a verification pass (or, without overlap, any step with a constrained row: the
grammar may draft what it forces) runs as named stages instead
(`_speculate`): plan drafts -> grammar checks them and adds its forced drafts (serial) -> one
verification forward over pending + forced + kept drafts -> sample every position -> commit the
accepted run.

New requests join between steps: their grammar answers its first Step before the prefill, so the
prompt and the grammar's initial forced tokens go through the model in one prefill pass. Requests
leave between steps (EOS, grammar end, stop string, length, abort, error), freeing their KV slot
and grammar state. All device work runs on one dedicated thread, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import grpc
import numpy as np

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import grammar_pb2, worker_pb2
from neuron_worker import device_thread
from neuron_worker.drafter import DraftBudget, Drafter, accepted_prefix, new_drafter
from neuron_worker.engine_config import EngineConfig
from neuron_worker.grammar_client import GrammarClient, GrammarRequest, RowOutcome
from neuron_worker.graphs import CompileCounter, Pass
from neuron_worker.metrics import Metrics
from neuron_worker.penalties import OccurrenceTable
from neuron_worker.request import Request, State, TokenLogprob
from neuron_worker.sampling_rows import PAD_ROW, SamplingRow, SamplingRows
from neuron_worker.scheduler import Scheduler, queue_full
from neuron_worker.speculation_gate import SpeculationGate
from neuron_worker.step_device import (
    DeviceLostError,
    Logits,
    SampleBatch,
    Sampled,
    StepDeviceLike,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

FR = worker_pb2.FinishReason


_EMPTY_LANGUAGE = RpcError(
    grpc.StatusCode.INVALID_ARGUMENT,
    "the constraint matches no output at all (its language is empty)",
    [("constraint", "matches nothing")],
    reason="EMPTY_LANGUAGE",
)


@dataclass
class _Row:
    """One request's slice of a forward pass: tokens to write starting at `start`; its last
    `outputs` tokens are the positions the pass draws at (more than one: speculative
    verification), those `wanted` names with logits."""

    req: Request
    tokens: list[int]
    start: int
    outputs: int = 1
    own_drafts: int = 0  # leading drafts that are the drafter's (the rest are the grammar's)
    # (start, count): drafts[start : start + count] are tokens the grammar forces, kept without
    # a sampling step (`RowOutcome.forced_jump`).
    jump: tuple[int, int] = (0, 0)

    def wanted(self) -> list[int]:
        """Which of the last `outputs` positions the pass returns logits for: all but the
        forced drafts', which are kept whatever is drawn there (an LM head row and a sampling
        row saved each; at c1 a field's three forced key tokens keep a verification pass within
        one read of the head's weights)."""
        start, count = self.jump
        return [j for j in range(self.outputs) if not start <= j < start + count]

    def positions(self) -> list[tuple[Request, int, int]]:
        """(request, mask row, sampling counter) of each logits row the pass returns for it: a
        forced draft's position has none, as a jump-forward token takes no counter."""
        start, count = self.jump
        return [(self.req, j, j - min(max(j - start, 0), count)) for j in self.wanted()]


@dataclass
class _Answered:
    """A request still running after the grammar's answer, before the pass's token budget."""

    req: Request
    prefix: list[int]  # pending + forced tokens
    drafts: list[int]  # its own kept drafts, or the grammar's forced drafts
    own: int  # leading drafts that are the row's own
    jump: tuple[int, int]  # forced tokens among the drafts (`_Row.jump`)
    closing: bool  # its own drafts close a string: the budget does not cut them


def _own_prefix(drafts: Sequence[int], own: Sequence[int]) -> int:
    """How many leading `drafts` are the row's `own` ones."""
    n = 0
    while n < min(len(drafts), len(own)) and drafts[n] == own[n]:
        n += 1
    return n


def _sync_history(drafter: Drafter, r: Request) -> None:
    """Feed the drafter the request's tokens it has not seen (prompt, then output)."""
    seen = len(drafter)
    if seen < len(r.prompt):
        drafter.extend(r.prompt[seen:], output=False)
        seen = len(r.prompt)
    drafter.extend(r.output[seen - len(r.prompt) :])


class Engine:
    """Owns the scheduler and the step loop; device work runs on `neuron_worker.device_thread`."""

    def __init__(
        self,
        *,
        device: StepDeviceLike,
        tokenizer: Tokenizer,
        grammar: GrammarClient | None,
        config: EngineConfig,
        metrics: Metrics | None = None,
    ) -> None:
        """``device``: the model, sampler and KV cache behind host-side calls (a
        :class:`~neuron_worker.step_device.StepDevice`, or rank 0's leader of a tensor-parallel
        group); only the engine's device thread calls it."""
        self.device = device
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.config = config
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            max_seq_len=config.max_seq_len,
            batch_buckets=config.batch_buckets,
            seq_buckets=config.seq_buckets,
            max_prefill_tokens=config.max_prefill_tokens,
        )
        self.requests: dict[str, Request] = {}  # by request id (an n > 1 call's choices: `ID/i`)
        # Live Generate calls by the call's id: its one request, or every choice of an n > 1
        # call. Call ids and request ids are one namespace (`_reserve`).
        self.calls: dict[str, list[Request]] = {}
        self.eos_ids = tuple(tokenizer.eos_token_ids)
        self.vocab_size = tokenizer.vocab_size
        self.words = tokenizer.words_per_row
        self.logits_size = device.logits_size
        self.pad_slot = device.pad_slot
        self.forward = device.runner  # the shapes of passes; `device.forward` runs them
        self.compiles = CompileCounter(self.metrics.compiled_while_serving)
        spec = config.speculative
        self.gate = SpeculationGate() if spec is not None and spec.gate else None
        # Moving average of the grammar's drafts after a row's own (`_verification_rows`).
        self.forced_tail = spec.forced_drafts / 2 if spec is not None else 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.draining = False
        self.lost: str | None = None  # why the device can no longer serve (`device_lost`)
        self.on_lost: Callable[[str], None] | None = None  # told once, on the event loop
        self._opening = 0  # submit calls still opening their grammars

    @property
    def occurrences(self) -> OccurrenceTable | None:
        """The device's penalty table (None before `start`)."""
        return self.device.occurrences

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Allocate the KV cache and start the loop."""
        await self._on_device(self.device.setup)
        self._task = asyncio.create_task(self._loop(), name="maskwire-engine")

    def serving(self) -> None:
        """Warm-up is over: from now on a compiled graph means a request waited for a compile
        (`maskwire_worker_compiles_while_serving_total`, which must stay 0)."""
        self.compiles.ready()

    def device_lost(self, reason: str) -> None:
        """The device can no longer serve (a tensor-parallel rank died): stop stepping, refuse
        new requests and fail every live one with UNAVAILABLE. Call on the event loop."""
        if self.lost is not None:
            return
        log.error("device lost: %s; failing every request", reason)
        self.lost = reason
        for req in list(self.requests.values()):
            self._finish(req, FR.FINISH_REASON_ERROR, status=self._unavailable())
        self._wake.set()
        if self.on_lost is not None:
            self.on_lost(reason)

    def _unavailable(self) -> RpcError:
        return RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"the worker cannot serve: {self.lost}",
            reason="DEVICE_LOST",
        )

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        for req in list(self.requests.values()):
            self._finish(req, FR.FINISH_REASON_ABORT, error="worker shutting down")
        if self.grammar is not None:
            await self.grammar.aclose()
        if self.lost is None:
            await self._on_device(self.device.close)

    async def _on_device(self, fn: Callable[[], T]) -> T:
        return await device_thread.run(fn)

    # ------------------------------------------------------------------ requests in and out
    async def submit(self, req: Request) -> list[str]:
        """Queue a validated request (opening its grammar first). Returns grammar warnings.

        Raises RpcError: RESOURCE_EXHAUSTED (queue full), ALREADY_EXISTS (live id), the grammar
        service's compile errors, UNAVAILABLE (no grammar replica), FAILED_PRECONDITION.
        """
        return await self.submit_group([req])

    async def submit_group(self, reqs: Sequence[Request], peer: str = "") -> list[str]:
        """Queue the choices of one call (n > 1) together, each with its own grammar session:
        all or none are queued, and they are admitted together so their prompt is prefilled
        once. `peer` is the client (its fair share of the queue). Returns the first choice's
        grammar warnings; raises as :meth:`submit`."""
        if self.draining:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if self.lost is not None:
            raise self._unavailable()
        call = reqs[0].call_id
        for req in reqs:
            req.peer = peer
        self._reserve(call, reqs)
        warnings: list[str] = []
        opened: list[Request] = []
        self._opening += 1
        try:
            self._check_queue(len(reqs), peer)
            for req in reqs:
                if req.constraint is not None:
                    w = await self._open_grammar(req, opened)
                    warnings = warnings or w
            self._check_queue(len(reqs), peer)
        except BaseException:
            self._unreserve(call, reqs)
            for req in opened:
                if self.grammar is not None and req.grammar is not None:
                    self.grammar.close(req.grammar)
            raise
        finally:
            self._opening -= 1
            self._wake.set()  # an admission wait may be holding on for this one (failed or not)
        if any(r.abort_reason is not None or r.finished for r in reqs):
            # Aborted (or failed by the worker) while its grammars were opening: end every
            # choice now instead of queueing it.
            reason = next((r.abort_reason for r in reqs if r.abort_reason), "aborted")
            for req in reqs:
                self._finish(req, FR.FINISH_REASON_ABORT, error=reason)
            return warnings
        for req in reqs:
            for other in self.scheduler.enqueue(req):  # another client's, over its fair share
                self._finish(
                    other, FR.FINISH_REASON_ERROR, status=queue_full(self.config.max_queue)
                )
        self.metrics.queue(self.scheduler.queue_depth, len(self.scheduler.running))
        self._wake.set()
        return warnings

    def _reserve(self, call: str, reqs: Sequence[Request]) -> None:
        """Take the call's id and its requests' ids (`ID/i` for n > 1), or raise ALREADY_EXISTS
        when any of them is a live call's or request's id. Taken before any await, so two
        calls can never both hold one id."""
        names = {call, *(r.request_id for r in reqs)}
        if any(name in self.calls or name in self.requests for name in names):
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {call!r} is already live on this worker",
                [("request_id", "must be unique among live requests")],
            )
        self.calls[call] = list(reqs)
        for req in reqs:
            self.requests[req.request_id] = req

    def _unreserve(self, call: str, reqs: Sequence[Request]) -> None:
        members = self.calls.get(call)
        if members is not None and members[0] is reqs[0]:
            del self.calls[call]
        for req in reqs:
            if self.requests.get(req.request_id) is req:
                del self.requests[req.request_id]

    async def _open_grammar(self, req: Request, opened: list[Request]) -> list[str]:
        if not self.config.structured_outputs or self.grammar is None:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker was started with --disable-structured-outputs; restart it with "
                "--enable-structured-outputs (and --grammar-service HOST:PORT) to use constraints",
                [("constraint", "structured outputs are disabled on this worker")],
                reason="STRUCTURED_OUTPUTS_DISABLED",
            )
        assert req.constraint is not None
        req.grammar = GrammarRequest(
            request_id=req.request_id,
            constraint=req.constraint,
            options=grammar_pb2.RequestOptions(
                reasoning_end_marker=req.reasoning_end_marker,
                jump_forward=self.config.jump_forward,
            ),
        )
        opened.append(req)
        return await self.grammar.open(req.grammar)

    def _check_queue(self, adding: int, peer: str) -> None:
        self.scheduler.check_room(peer, adding)

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop the live call with this id (every choice of an n > 1 call). False when there
        is none."""
        reqs = self.calls.get(request_id)
        return reqs is not None and self.abort_requests(reqs, reason)

    def abort_requests(self, reqs: Sequence[Request], reason: str = "aborted") -> bool:
        """Stop these requests: at once if waiting, at the next step boundary if running,
        before they are queued if still opening their grammars. True if any was live."""
        found = False
        for r in reqs:
            if r.finished:
                continue
            found = True
            if r.state is State.WAITING and r in self.scheduler.waiting:
                self._finish(r, FR.FINISH_REASON_ABORT, error=reason)
            else:
                r.abort_reason = reason
                self._wake.set()
        return found

    def _finish(
        self,
        req: Request,
        reason: int,
        *,
        stop_string: str = "",
        error: str = "",
        status: RpcError | None = None,
    ) -> None:
        if req.finished:
            return
        self.scheduler.release(req)
        req.pending = None
        if req.grammar is not None and self.grammar is not None:
            self.grammar.close(req.grammar)
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
        call = req.call_id
        members = self.calls.get(call)
        if members is not None and req in members and all(r.finished for r in members):
            del self.calls[call]
        if status is not None:
            req.outputs.put_nowait(status)
        else:
            req.outputs.put_nowait(req.final_message(reason, stop_string=stop_string, error=error))
        self.metrics.finished(
            FR.Name(reason).removeprefix("FINISH_REASON_").lower(), req.constrained
        )

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        while not self._stopping and self.lost is None:
            try:
                self._reap_aborted()
                await self._gather_arrivals()
                admitted = self.scheduler.admit()
                if admitted:
                    await self._prefill(admitted)
                    self._flush_outputs()  # first tokens out now, not after the next step
                batch = [r for r in self.scheduler.running if r.pending is not None]
                if batch:
                    await self._decode(batch)
                self._flush_outputs()
                self.compiles.check()
                self.metrics.queue(self.scheduler.queue_depth, len(self.scheduler.running))
                if not batch and not self.scheduler.waiting:
                    self._wake.clear()
                    if not any(r.abort_reason for r in self.scheduler.running):
                        await self._wake.wait()
            except DeviceLostError as e:
                self.device_lost(str(e))
            except Exception as e:  # never let one bad step kill the worker
                if self.lost is not None:
                    break  # `device_lost` failed every request already
                log.exception("engine step failed; failing the running requests")
                for req in list(self.scheduler.running):
                    self._finish(req, FR.FINISH_REASON_ERROR, error=f"internal error: {e}")

    async def _gather_arrivals(self) -> None:
        """From idle, hold the first arrival until requests stop coming (`admit_quiet_s` without
        one while no other is still opening its grammar, `admit_window_s` at most, or a full
        batch), so that requests sent together share one prefill. Without it the first prompt's
        prefill takes both cores at once, and the rest, slowed down on their way in, wait for
        it and then need a pass of their own. Grammar opens (a compile, or a cache hit and the
        first mask) can each take longer than the quiet gap on a busy host."""
        cfg = self.config
        if cfg.admit_window_s <= 0 or self.scheduler.running or not self.scheduler.waiting:
            return
        deadline = time.perf_counter() + cfg.admit_window_s
        while self.scheduler.queue_depth < cfg.max_batch and not self._stopping:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), min(cfg.admit_quiet_s, remaining))
            except TimeoutError:
                if not self._opening:
                    return

    def _reap_aborted(self) -> None:
        for req in list(self.scheduler.running):
            if req.abort_reason is not None:
                self._finish(req, FR.FINISH_REASON_ABORT, error=req.abort_reason)

    def _flush_outputs(self) -> None:
        for req in self.scheduler.running:
            msg = req.flush_message()
            if msg is not None:
                req.outputs.put_nowait(msg)

    # ------------------------------------------------------------------ prefill
    async def _prefill(self, reqs: list[Request]) -> None:
        """Grammar first step (its forced tokens streamed at once), then one forward over prompt
        + forced tokens, then sample."""
        started = time.perf_counter()
        constrained = [r for r in reqs if r.grammar is not None]
        outcomes: dict[Request, RowOutcome] = {}
        if constrained:
            assert self.grammar is not None
            res = await self.grammar.step([(r.grammar, []) for r in constrained])  # type: ignore[misc]
            outcomes = dict(zip(constrained, res, strict=True))
        rows: list[_Row] = []
        # n > 1: the first choice of a call prefills; the others copy its K/V and logits.
        leaders: dict[str, _Row] = {}
        shared: list[tuple[_Row, _Row]] = []
        for req in reqs:
            out = outcomes.get(req)
            ff: list[int] = []
            if out is not None:
                if not out.ok:
                    # Nothing was streamed yet: report a gRPC status instead of a half answer.
                    self._finish(req, FR.FINISH_REASON_ERROR, status=out.status())
                    continue
                ff = out.ff_tokens
                if ff and self._append(req, ff, forced=True):
                    continue
                if out.finished and not out.accepting:
                    # The grammar can produce nothing and is not complete: its language is empty.
                    # Ending with `stop` would pass an empty, non-matching output off as success.
                    self._finish(req, FR.FINISH_REASON_ERROR, status=_EMPTY_LANGUAGE)
                    continue
                if out.finished:
                    self._finish(req, FR.FINISH_REASON_STOP)
                    continue
            row = _Row(req, req.prompt + ff, 0)
            leader = leaders.get(req.group) if req.group else None
            if leader is not None and leader.tokens == row.tokens:
                shared.append((row, leader))  # same prompt and forced tokens: no forward of its own
                continue
            rows.append(row)
            if req.group:
                leaders.setdefault(req.group, row)
        if not rows:
            return
        # The grammar's forced prefix (`{"name": "` of a JSON schema) is output already: stream it
        # now rather than after the prefill pass, the longest wait of a request's first token.
        self._flush_outputs()
        logits = await self._forward(rows, "prefill")
        for row in rows:
            row.req.cached = len(row.tokens)
        if shared:
            logits = await self._share_prefill(logits, rows, shared)
            for row, _ in shared:
                row.req.cached = len(row.tokens)
            rows += [row for row, _ in shared]
        await self._sample_rows(rows, logits, outcomes)
        log.debug(
            "prefill of %d requests took %.1f ms", len(rows), 1e3 * (time.perf_counter() - started)
        )

    # ------------------------------------------------------------------ decode
    async def _decode(self, batch: list[Request]) -> None:
        """One decode step: plan drafts, then a speculative step (`_speculate`) when some row
        has drafts worth verifying (`SpeculationGate`) or may get forced ones, else a plain
        step. The gate learns from the step's wall time."""
        drafts = self._worth_verifying(batch, self._plan_drafts(batch))
        started = time.perf_counter()
        verified = 0
        if drafts or self._forced_drafts_apply(batch):
            verified = await self._speculate(batch, drafts)
        else:
            await self._decode_plain(batch)
        if self.gate is not None:
            # A step without drafts of its own (forced drafts only) is what the gate's "no"
            # costs: it counts as a plain step.
            n = verified if drafts else 0
            self.gate.record(len(batch), n, time.perf_counter() - started)

    def _worth_verifying(
        self, batch: list[Request], drafts: dict[Request, list[int]]
    ) -> dict[Request, list[int]]:
        """The drafts this step verifies: all of them, or none when the gate finds the wider
        pass not worth the tokens they are expected to add."""
        if self.gate is None or not drafts:
            return drafts
        rows = []
        for r, d in drafts.items():
            assert r.budget is not None  # made with its drafter
            # Drafts that close a quoted string are likely to get the grammar's forced tokens
            # after them (the next key), as many as such tails have had so far.
            tail = self.forced_tail if self._brings_tail(r, d) else 0.0
            rows.append((len(d), r.budget.acceptance(), tail))
        if self.gate.worth_it(len(batch), rows):
            return drafts
        self.metrics.drafts(declined=sum(len(d) for d in drafts.values()))
        return {}

    def _propose(self, drafter: Drafter, want: int, most: int) -> list[int]:
        """The drafter's proposal, `want` drafts at most, or up to `most` when they are a copy
        that closes a quoted string: a copy cut before its closing quote gets no forced tail
        from the grammar, and the tail is most of what such drafts are worth."""
        d = drafter.propose(most)
        return d if d and self._closes_quote(d) else d[:want]

    def _closes_quote(self, drafts: list[int]) -> bool:
        return self.tokenizer.token_bytes(drafts[-1]).endswith(b'"')

    def _brings_tail(self, r: Request, drafts: list[int]) -> bool:
        """Whether `drafts` may get the grammar's forced tail: they close a quoted string of a
        constrained output."""
        return r.grammar is not None and bool(drafts) and self._closes_quote(drafts)

    def _forced_drafts_apply(self, batch: list[Request]) -> bool:
        """Whether a step should ask the grammar for forced drafts although no row has its own:
        with speculation on and the grammar waited for before the forward anyway (no overlap),
        the speculative step costs nothing more than the plain one."""
        if self.config.speculative is None or self.config.overlap:
            return False
        return any(r.speculate and r.grammar is not None for r in batch)

    def _grammar_entries(
        self, batch: list[Request]
    ) -> tuple[list[Request], list[tuple[GrammarRequest, list[int]]]]:
        """Each constrained request's tokens the grammar has not seen (accepted drafts, then the
        pending token); the accepted drafts count as sent from now on."""
        constrained: list[Request] = []
        entries: list[tuple[GrammarRequest, list[int]]] = []
        for r in batch:
            if r.grammar is not None:
                constrained.append(r)
                entries.append((r.grammar, [*r.verified, r.pending]))  # type: ignore[list-item]
            r.verified = []
        return constrained, entries

    def _apply_answer(self, r: Request, out: RowOutcome | None) -> list[int] | None:
        """The grammar's answer for a running request: errors, forced tokens, ends. Returns the
        forced tokens (appended) or None when the request finished."""
        if out is None:
            return []
        if not out.ok:
            self._finish(r, FR.FINISH_REASON_ERROR, error=f"constraint failed: {out.error}")
            return None
        ff = out.ff_tokens
        if ff and self._append(r, ff, forced=True):
            return None  # finished (stop string or length) inside the forced tokens
        if out.finished and not out.accepting:
            self._finish(
                r, FR.FINISH_REASON_ERROR, error="constraint failed: dead end before a match"
            )
            return None
        if out.finished:
            self._finish(r, FR.FINISH_REASON_STOP)
            return None
        return ff

    async def _decode_plain(self, batch: list[Request]) -> None:
        started = time.perf_counter()
        constrained, entries = self._grammar_entries(batch)
        grammar_task: asyncio.Task[list[RowOutcome]] | None = None
        if entries:
            assert self.grammar is not None
            grammar_task = asyncio.create_task(self.grammar.step(entries))
        outcomes: dict[Request, RowOutcome] = {}
        logits: Logits | None = None
        if grammar_task is None or self.config.overlap:
            rows = [_Row(r, [r.pending], r.cached) for r in batch]  # type: ignore[list-item]
            logits = await self._forward(rows, "decode")
            if grammar_task is not None:
                outcomes = await self._await_grammar(grammar_task, constrained)
            for r in batch:
                r.cached += 1
        else:
            assert grammar_task is not None
            outcomes = await self._await_grammar(grammar_task, constrained)

        # Apply the grammar's answers: errors, forced tokens, ends.
        live: list[Request] = []
        ff_rows: list[_Row] = []
        for r in batch:
            pending = r.pending
            r.pending = None
            ff = self._apply_answer(r, outcomes.get(r))
            if ff is None:
                continue
            live.append(r)
            if self.config.overlap or grammar_task is None:
                if ff:
                    ff_rows.append(_Row(r, ff, r.cached))
            else:
                ff_rows.append(_Row(r, [pending, *ff], r.cached))  # type: ignore[list-item]

        serial = not self.config.overlap and grammar_task is not None
        sample_rows: list[Request | None]
        if serial:
            # No overlap: one forward of pending + forced tokens for every live row.
            if not ff_rows:
                self.metrics.step(time.perf_counter() - started, len(batch))
                return
            logits = await self._forward(ff_rows, "decode")
            for row in ff_rows:
                row.req.cached += len(row.tokens)
            sample_rows = [row.req for row in ff_rows]
        else:
            assert logits is not None
            if ff_rows:
                # Jump-forward: the forced tokens in one multi-token pass; the logits of their last
                # position replace the row's decode logits.
                ff_logits = await self._forward(ff_rows, "jump_forward")
                for row in ff_rows:
                    row.req.cached += len(row.tokens)
                position = {id(r): i for i, r in enumerate(batch)}
                dst = [position[id(row.req)] for row in ff_rows]
                base = logits
                logits = await self._on_device(lambda: self.device.replace(base, ff_logits, dst))
            live_set = set(live)
            sample_rows = [r if r in live_set else None for r in batch]
        if live:
            await self._sample_rows(sample_rows, logits, outcomes)
        self.metrics.step(time.perf_counter() - started, len(batch))

    async def _await_grammar(
        self, task: asyncio.Task[list[RowOutcome]], constrained: list[Request]
    ) -> dict[Request, RowOutcome]:
        waited = time.perf_counter()
        res = await task
        self.metrics.mask_wait(time.perf_counter() - waited)
        return dict(zip(constrained, res, strict=True))

    # ------------------------------------------------------------------ speculative decode
    def _plan_drafts(self, batch: list[Request]) -> dict[Request, list[int]]:
        """Stage 1: each request's draft tokens (none when speculation is off for it), within
        the pass's token budget (`DraftConfig.pass_tokens`; each row's pending token counts),
        but a copy that closes a string of a constrained output (`_brings_tail`) is kept whole
        and not counted: the grammar's forced tail comes with it, and verified without a
        budget such copies paid at c8 where other drafts did not."""
        spec = self.config.speculative
        if spec is None:
            return {}
        left = spec.pass_tokens - len(batch) if spec.pass_tokens else None
        drafts: dict[Request, list[int]] = {}
        for r in batch:
            if not r.speculate:
                continue
            if r.drafter is None:
                r.drafter = new_drafter(spec, self.tokenizer.token_bytes, self.tokenizer.encode)
                r.budget = DraftBudget(spec)
            assert r.budget is not None
            _sync_history(r.drafter, r)
            most = min(spec.num_draft_tokens, self._room(r) - 1)
            want = min(r.budget.want(), most)
            d = self._propose(r.drafter, want, most) if want > 0 else []
            if left is not None and not self._brings_tail(r, d):
                d = d[: max(0, left)]
                left -= len(d)
            if d:
                drafts[r] = d
                self.metrics.drafts(proposed=len(d))
        return drafts

    async def _speculate(self, batch: list[Request], drafts: dict[Request, list[int]]) -> int:
        """A step with drafts: the grammar checks them first (their rejected tail never reaches
        the device), one forward verifies every kept draft, the sampler draws a token at every
        position but a forced draft's, and each request keeps its drafts up to the first the
        sampler disagrees with. Returns the number of drafts verified (the drafter's and the
        grammar's)."""
        started = time.perf_counter()
        outcomes = await self._check_drafts(batch, drafts)
        rows = self._verification_rows(batch, drafts, outcomes)
        if rows:
            logits = await self._forward(rows, "verify")
            positions = [p for row in rows for p in row.positions()]
            sampled = await self._sample(positions, logits, outcomes)
            self._commit(rows, sampled)
        self.metrics.step(time.perf_counter() - started, len(batch))
        return sum(row.outputs - 1 for row in rows)

    async def _check_drafts(
        self, batch: list[Request], drafts: dict[Request, list[int]]
    ) -> dict[Request, RowOutcome]:
        """Stage 2: the grammar's answers (new tokens applied, drafts validated, not consumed).
        Serial: the forward needs to know which drafts survive."""
        constrained, entries = self._grammar_entries(batch)
        if not entries:
            return {}
        assert self.grammar is not None
        spec = self.config.speculative
        assert spec is not None
        room = [
            max(0, min(spec.forced_drafts, self._room(r) - 1)) if r.speculate else 0
            for r in constrained
        ]
        task = asyncio.create_task(
            self.grammar.step(
                entries,
                drafts=[drafts.get(r, []) for r in constrained],
                forced_draft_room=room,
            )
        )
        return await self._await_grammar(task, constrained)

    def _verification_rows(
        self,
        batch: list[Request],
        drafts: dict[Request, list[int]],
        outcomes: dict[Request, RowOutcome],
    ) -> list[_Row]:
        """Stage 3: apply the grammar's answers; each live request becomes one row of pending +
        forced + kept drafts, with logits wanted at every draft position (but a forced draft's,
        `_Row.wanted`) and the one after.
        Forced tokens count against the pass's token budget before drafts do; the grammar's
        forced drafts do not count (it forces those bytes: they are nearly always accepted, and
        at c8 they were worth their width, 1.07x against 0.94x with them in the budget), nor do
        own drafts that close a string (stage 1)."""
        live: list[_Answered] = []
        for r in batch:
            pending = r.pending
            r.pending = None
            out = outcomes.get(r)
            ff = self._apply_answer(r, out)
            if ff is None:
                continue
            d = drafts.get(r, [])
            own = len(d)
            jump = (0, 0)
            if out is not None and out.forced_drafts:
                # The grammar's drafts: after its forced tokens (none of the row's own), or the
                # row's own drafts and the bytes forced after them (`_own_prefix` of them).
                own = 0 if ff else _own_prefix(out.forced_drafts, d)
                tail = len(out.forced_drafts) - own
                self.metrics.drafts(forced=tail)
                if own:
                    self.forced_tail += 0.2 * (tail - self.forced_tail)
                d, jump = out.forced_drafts, out.forced_jump
            elif out is not None:
                d = d[: out.accepted_drafts]
            closing = self._brings_tail(r, drafts.get(r, []))
            d = d[: max(0, self._room(r) - 1)]
            prefix: list[int] = [pending, *ff]  # type: ignore[list-item]
            live.append(_Answered(r, prefix, d, min(own, len(d)), jump, closing))
        spec = self.config.speculative
        left = None
        if spec is not None and spec.pass_tokens:
            left = spec.pass_tokens - sum(len(a.prefix) for a in live)
        rows: list[_Row] = []
        for a in live:
            d, own = a.drafts, a.own
            if left is not None and not a.closing:
                if own > max(0, left):
                    own = max(0, left)  # the grammar's drafts after them go with them
                    d = d[:own]
                left -= own
            start, count = a.jump
            jump = (start, max(0, min(count, len(d) - start)))  # drafts cut by the limits
            self.metrics.drafts(kept=len(d))
            r = a.req
            rows.append(_Row(r, [*a.prefix, *d], r.cached, 1 + len(d), own_drafts=own, jump=jump))
            r.cached += len(a.prefix)
        return rows

    def _commit(self, rows: list[_Row], sampled: Sampled) -> None:
        """Stage 5: per row, the drafts the sampler agreed with and the token after them."""
        i = 0
        accepted_total = emitted = 0
        for row in rows:
            r = row.req
            d = row.tokens[len(row.tokens) - row.outputs + 1 :]
            start, count = row.jump
            forced = range(start, start + count)
            at = {j: i + n for n, j in enumerate(row.wanted())}  # position -> logits row
            i += len(at)
            # No draw at a forced position: `accepted_prefix` keeps the draft there.
            drawn = [sampled.tokens[at[j]] if j in at else -1 for j in range(row.outputs)]
            a = accepted_prefix(drawn, d, forced)
            if r.budget is not None and row.own_drafts:
                r.budget.record(row.own_drafts, min(a, row.own_drafts))
            r.draft_tokens += len(d)
            r.accepted_drafts += a
            accepted_total += a
            for j in range(a + 1):
                if r.finished:
                    break
                if j in forced:
                    if self._append(r, [d[j]], forced=True):
                        break
                else:
                    lp = sampled.logprobs[at[j]] if sampled.logprobs else None
                    self._accept(r, drawn[j], lp)
                    emitted += 1
                if j < a and not r.finished:  # an accepted draft: its K/V is in the cache
                    r.cached += 1
                    r.verified.append(d[j])
                    r.pending = None
        self.metrics.drafts(accepted=accepted_total)
        self.metrics.tokens(emitted, 0)

    def _room(self, r: Request) -> int:
        """Tokens the request may still add (max_tokens and the context limit)."""
        return min(r.sampling.max_tokens - len(r.output), self.config.max_seq_len - r.seq_len)

    # ------------------------------------------------------------------ device work
    async def _forward(self, rows: list[_Row], kind: str) -> Logits:
        """One forward pass over `rows`; returns logits for each row's `wanted` positions, row
        after row (then padding rows: garbage)."""
        end = max(row.start + len(row.tokens) for row in rows)
        n, t, kv_len = self.forward.shape(len(rows), max(len(r.tokens) for r in rows), end)
        wanted = [row.wanted() for row in rows]
        count = self.forward.logits_count(n, sum(map(len, wanted)), max(map(len, wanted)))
        tokens = np.zeros((n, t), dtype=np.int64)
        pos = np.full((n, t), -1, dtype=np.int64)
        slots = np.full(n, self.pad_slot, dtype=np.int64)
        last = np.zeros(count, dtype=np.int64)
        o = 0
        for i, (row, want) in enumerate(zip(rows, wanted, strict=True)):
            k = len(row.tokens)
            tokens[i, :k] = row.tokens
            pos[i, :k] = np.arange(row.start, row.start + k)
            slots[i] = row.req.slot
            last[o : o + len(want)] = i * t + k - row.outputs + np.asarray(want)
            o += len(want)
            row.req.forward_passes += 1
        p = Pass(tokens, pos, slots, last, kv_len, prefill=kind == "prefill")
        began = time.perf_counter()
        logits = await self._on_device(lambda: self.device.forward(p))
        self.metrics.forward(kind, time.perf_counter() - began)
        return logits

    async def _sample_rows(
        self,
        rows: Sequence[_Row | Request | None],
        logits: Logits,
        outcomes: dict[Request, RowOutcome],
    ) -> None:
        """Mask and sample each row (None: a row whose request already left; its sample is
        ignored), then act on the tokens."""
        reqs = [row.req if isinstance(row, _Row) else row for row in rows]
        result = await self._sample(
            [(r, 0, 0) if r is not None else None for r in reqs], logits, outcomes
        )
        sampled = 0
        for i, (req, tok) in enumerate(zip(reqs, result.tokens, strict=False)):
            if req is None or req.finished:
                continue
            sampled += 1
            self._accept(req, tok, result.logprobs[i] if result.logprobs else None)
        self.metrics.tokens(sampled, 0)

    async def _sample(
        self,
        positions: Sequence[tuple[Request, int, int] | None],
        logits: Logits,
        outcomes: dict[Request, RowOutcome],
    ) -> Sampled:
        """(Stage 4 of a speculative step.) Mask and sample every logits row: `positions[i]` =
        (request, j, c) for the request's j-th position of this step (its j-th mask row; random
        counter `sampled + c`), None for a row to ignore. Returns one token per logits row, and
        the logprobs when a row asked for them."""
        n = logits.rows
        # Rows past the m-th stay uninitialised: their `dest` is n, so scatter_mask_rows drops them.
        compact = np.empty((n, self.words), dtype=np.int32)
        dest = np.full(n, n, dtype=np.int64)
        ban_eos = np.zeros(n, dtype=bool)
        rows = SamplingRows([])
        m = 0
        for i, at in enumerate(positions):
            if at is None:  # a greedy row whose token is ignored
                rows.rows.append(PAD_ROW)
                continue
            req, j, c = at
            # A draft position (j > 0) has no extras: requests with penalties or logprobs
            # never draft.
            rows.rows.append(self._row(rows, req, c) if j == 0 else self._draft_row(req, c))
            out = outcomes.get(req)
            if out is not None and out.mask is not None:
                compact[m] = out.mask[j]
                dest[m] = i
                m += 1
            ban_eos[i] = req.sampling.ignore_eos and req.grammar is None

        batch = SampleBatch(compact, dest, ban_eos, rows)

        def run() -> Sampled:
            return self.device.sample(logits, batch)

        began = time.perf_counter()
        result = await self._on_device(run)
        self.metrics.sample(time.perf_counter() - began)
        return result

    @staticmethod
    def _draft_row(req: Request, c: int) -> SamplingRow:
        s = req.sampling
        return SamplingRow(s.temperature, s.top_p, s.top_k, s.seed, req.sampled + c)

    @staticmethod
    def _row(rows: SamplingRows, req: Request, c: int) -> SamplingRow:
        """A request's sampled position, with its penalties and logprobs (and their table
        updates, added to `rows`)."""
        s = req.sampling
        rows.any_logprobs = rows.any_logprobs or s.logprobs
        row = SamplingRow(
            s.temperature, s.top_p, s.top_k, s.seed, req.sampled + c, raw_logprobs=s.raw_logprobs
        )
        if not s.penalized:
            return row
        rows.any_penalty = True
        if req.sampled == 0:  # the request's first sample: its table row starts over
            rows.reset.append((req.slot, req.prompt))
        # Output tokens since the last penalised sample (sampled and forced).
        rows.count.extend((req.slot, t) for t in req.output[req.counted :])
        req.counted = len(req.output)
        return replace(
            row,
            presence=s.presence_penalty,
            frequency=s.frequency_penalty,
            repetition=s.repetition_penalty,
            logit_bias=s.logit_bias,
            slot=req.slot,
        )

    # ------------------------------------------------------------------ warm-up
    async def warmup(self, on_graph: Callable[[str], None] | None = None) -> int:
        """Run every graph shape the step loop can produce once, on padding inputs (the pad
        slot's scratch position), so a static-shape backend (XLA) compiles them all before
        serving. `on_graph(label)` is called after each one. Returns the number of graphs."""
        began = time.perf_counter()
        last = began

        def graph_done(label: str) -> None:
            # Per graph, so that an operator sees where a slow (cold-cache) start goes.
            nonlocal last
            now = time.perf_counter()
            log.info("warm-up: %s in %.1fs", label, now - last)
            last = now
            if on_graph is not None:
                on_graph(label)

        count = await self._on_device(lambda: self.device.warmup(graph_done))
        log.info("warm-up ran %d graphs in %.1fs", count, time.perf_counter() - began)
        return count

    async def _share_prefill(
        self, logits: Logits, rows: list[_Row], shared: list[tuple[_Row, _Row]]
    ) -> Logits:
        """n > 1: each follower's slot gets its leader's prompt K/V (copied up to the sequence
        bucket), and the logits gain one row per follower, its leader's (padded to a batch
        bucket the sampler takes)."""
        position = {id(row): i for i, row in enumerate(rows)}
        index = list(range(len(rows)))
        copies: list[tuple[int, int, int]] = []
        for row, leader in shared:
            length = self.forward.shape(1, 1, len(row.tokens))[2]
            copies.append((leader.req.slot, row.req.slot, length))
            index.append(position[id(leader)])
        total = self.forward.shape(len(index), 1, 1)[0]
        index += [0] * (total - len(index))
        return await self._on_device(lambda: self.device.share(logits, copies, index))

    # ------------------------------------------------------------------ token bookkeeping
    def _accept(self, req: Request, tok: int, logprob: TokenLogprob | None = None) -> None:
        """A sampled token: end the request or make it the next step's pending token."""
        req.sampled += 1
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if tok < 0 or tok >= self.vocab_size:
            self._finish(
                req,
                FR.FINISH_REASON_ERROR,
                error="the constraint allows no token here (grammar dead end)",
            )
            return
        s = req.sampling
        if tok in s.stop_token_ids or (
            tok in self.eos_ids and not (s.ignore_eos and req.grammar is None)
        ):
            self._finish(req, FR.FINISH_REASON_STOP)
            return
        if self._append(req, [tok], forced=False, logprob=logprob):
            return
        req.pending = tok

    def _append(
        self,
        req: Request,
        tokens: list[int],
        *,
        forced: bool,
        logprob: TokenLogprob | None = None,
    ) -> bool:
        """Add tokens within the request's limits; True when the request finished."""
        take = tokens[: max(self._room(req), 0)]
        stop = req.append(take, forced=forced, logprob=logprob) if take else None
        if forced:
            self.metrics.tokens(0, len(take))
        if stop is not None:
            self._finish(req, FR.FINISH_REASON_STOP_STRING, stop_string=stop)
            return True
        if len(take) < len(tokens) or self._room(req) <= 0:
            self._finish(req, FR.FINISH_REASON_LENGTH)
            return True
        return False
