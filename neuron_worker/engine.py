"""The step loop: continuous batching with the grammar round trip hidden behind the forward pass.

Each turn (`Engine.step`) lets aborted requests leave, admits waiting ones (`Scheduler.admit`)
and prefills them, then runs one decode step for the running requests (each holds the token it
sampled last, `pending`). A decode step is a few named stages, each with typed hand-offs:

    plan      the batch, and its drafts (`Speculator.plan`; none without --speculative)
    grammar   Step(pending tokens) to the grammar replicas: `GrammarCall` -> `Answers`
    forward   `ForwardBatch` of `Row`s -> `Logits` (device thread)
    answers   `Ledger.apply_answer`: the grammar's forced tokens, ends and errors
    sample    `Draw`s -> `SampleBatch` -> `Sampled` (device thread, compiled masked sampler)
    commit    `Ledger.accept_draws` / `Speculator.commit`: append, stop checks; deltas streamed

A plain step runs them on one of three schedules: plain (no row constrained: no grammar stage),
overlapped (the forward of the pending tokens runs while the grammar computes the masks; forced
tokens then take one jump-forward pass) or serial (without `overlap`, answers first, then one
pass over pending + forced tokens). A speculative step (`neuron_worker.speculator`) is serial,
its forward a verification pass. Where the logits are needed for nothing but their sampling
(plain, serial, speculative), forward and sample are one call on the device thread.

New requests join between steps: their grammar answers its first Step before the prefill, so the
prompt and the grammar's initial forced tokens go through the model in one prefill pass. Requests
leave between steps (EOS, grammar end, stop string, length, abort, error), freeing their KV slot
and grammar state. All device work runs on one dedicated thread, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from maskwire.tokenizer import Tokenizer
from neuron_worker.detokenize import Detokenizer
from neuron_worker.device_stage import DeviceStage, on_device
from neuron_worker.engine_config import EngineConfig
from neuron_worker.events import EngineError, ErrorKind, FinishReason
from neuron_worker.grammar_client import GrammarClient
from neuron_worker.grammar_stage import GrammarCall, first_step, grammar_request, send_step
from neuron_worker.graphs import CompileCounter
from neuron_worker.ledger import Ledger
from neuron_worker.metrics import Metrics
from neuron_worker.penalties import OccurrenceTable
from neuron_worker.request import Request, Sampling, State
from neuron_worker.scheduler import Scheduler, queue_full
from neuron_worker.speculator import Drafts, Speculator
from neuron_worker.step_device import DeviceLostError, Logits, StepDeviceLike
from neuron_worker.step_rows import Answers, Draw, ForwardBatch, Row

log = logging.getLogger(__name__)

FR = FinishReason


def _pending(r: Request) -> int:
    assert r.pending is not None  # a decode step's requests all hold one
    return r.pending


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
            kv_slots=config.kv_slots,
            max_queue=config.max_queue,
            max_seq_len=config.max_seq_len,
            batch_buckets=config.batch_buckets,
            seq_buckets=config.seq_buckets,
            max_prefill_tokens=config.max_prefill_tokens,
            prefix_cache=config.prefix_cache,
        )
        self.requests: dict[str, Request] = {}  # by request id (an n > 1 call's choices: `ID/i`)
        # Live Generate calls by the call's id: its one request, or every choice of an n > 1
        # call. Call ids and request ids are one namespace (`_reserve`).
        self.calls: dict[str, list[Request]] = {}
        self.words = tokenizer.words_per_row
        self.logits_size = device.logits_size
        self.compiles = CompileCounter(self.metrics.compiled_while_serving)
        self.stage = DeviceStage(device, self.metrics, self.words)
        self.ledger = Ledger(
            vocab_size=tokenizer.vocab_size,
            eos_ids=tokenizer.eos_token_ids,
            max_seq_len=config.max_seq_len,
            metrics=self.metrics,
            finish=self._finish,
        )
        self.speculator = Speculator.of(config, tokenizer, self.ledger, self.metrics)
        self._wake = asyncio.Event()
        self._busy_at = 0.0  # time.monotonic() when a step last admitted or decoded
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
        await on_device(self.device.setup)
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
            self._finish(req, FR.ERROR, status=self._unavailable())
        self._wake.set()
        if self.on_lost is not None:
            self.on_lost(reason)

    def _unavailable(self) -> EngineError:
        return EngineError(
            ErrorKind.UNAVAILABLE,
            f"the worker cannot serve: {self.lost}",
            reason="DEVICE_LOST",
        )

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        for req in list(self.requests.values()):
            self._finish(req, FR.ABORT, error="worker shutting down")
        if self.grammar is not None:
            await self.grammar.aclose()
        if self.lost is None:
            await on_device(self.device.close)

    # ------------------------------------------------------------------ requests in and out
    async def submit(self, req: Request) -> list[str]:
        """Queue a validated request (opening its grammar first). Returns grammar warnings.

        Raises EngineError: RESOURCE_EXHAUSTED (queue full), ALREADY_EXISTS (live id),
        FAILED_PRECONDITION (structured outputs disabled), UNAVAILABLE (shutting down, device
        lost); the grammar client's errors as they are (the grammar service's compile errors,
        UNAVAILABLE: no grammar replica).
        """
        return await self.submit_group([req])

    async def submit_group(self, reqs: Sequence[Request], peer: str = "") -> list[str]:
        """Queue the choices of one call (n > 1) together, each with its own grammar session:
        all or none are queued, and they are admitted together so their prompt is prefilled
        once. `peer` is the client (its fair share of the queue). Returns the first choice's
        grammar warnings; raises as :meth:`submit`."""
        if self.draining:
            raise EngineError(ErrorKind.UNAVAILABLE, "the worker is shutting down")
        if self.lost is not None:
            raise self._unavailable()
        call = reqs[0].call_id
        for req in reqs:
            req.peer = peer
        self._reserve(call, reqs)
        warnings: list[str] = []
        opened: list[Request] = []
        self._opening += 1
        shed: list[Request] = []
        try:
            # Refused before its grammars are compiled when the queue has no room for it now;
            # enqueue() applies the same rule to the queue as it is once they are open.
            self.scheduler.check_room(peer, len(reqs))
            for req in reqs:
                if req.constraint is not None:
                    w = await self._open_grammar(req, opened)
                    warnings = warnings or w
            # Aborted (or failed by the worker) while its grammars were opening: not queued.
            aborted = any(r.abort_reason is not None or r.finished for r in reqs)
            if not aborted:
                shed = self.scheduler.enqueue(reqs)
        except BaseException:
            self._unreserve(call, reqs)
            for req in opened:
                if self.grammar is not None and req.grammar is not None:
                    self.grammar.close(req.grammar)
            raise
        finally:
            self._opening -= 1
            self._wake.set()  # an admission wait may be holding on for this one (failed or not)
        if aborted:
            reason = next((r.abort_reason for r in reqs if r.abort_reason), "aborted")
            for req in reqs:
                self._finish(req, FR.ABORT, error=reason)
            return warnings
        for other in shed:  # another client's, over its fair share
            self._finish(other, FR.ERROR, status=queue_full(self.config.max_queue))
        self.metrics.queue(self.scheduler.queue_depth, len(self.scheduler.running))
        self._wake.set()
        return warnings

    def _reserve(self, call: str, reqs: Sequence[Request]) -> None:
        """Take the call's id and its requests' ids (`ID/i` for n > 1), or raise ALREADY_EXISTS
        when any of them is a live call's or request's id. Taken before any await, so two
        calls can never both hold one id."""
        names = {call, *(r.request_id for r in reqs)}
        if any(name in self.calls or name in self.requests for name in names):
            raise EngineError(
                ErrorKind.ALREADY_EXISTS,
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
            raise EngineError(
                ErrorKind.FAILED_PRECONDITION,
                "this worker was started with --disable-structured-outputs; restart it with "
                "--enable-structured-outputs (and --grammar-service HOST:PORT) to use constraints",
                [("constraint", "structured outputs are disabled on this worker")],
                reason="STRUCTURED_OUTPUTS_DISABLED",
            )
        req.grammar = grammar_request(req, jump_forward=self.config.jump_forward)
        opened.append(req)
        return await self.grammar.open(req.grammar)

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
                self._finish(r, FR.ABORT, error=reason)
            else:
                r.abort_reason = reason
                self._wake.set()
        return found

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        *,
        stop_string: str = "",
        error: str = "",
        status: Exception | None = None,
    ) -> None:
        if req.finished:
            return
        self.scheduler.release(req, answered=reason in (FR.STOP, FR.LENGTH, FR.STOP_STRING))
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
            req.outputs.put_nowait(req.final(reason, stop_string=stop_string, error=error))
        self.metrics.finished(reason.value, req.constrained)

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        while not self._stopping and self.lost is None:
            try:
                stepped = await self.step()
                if not stepped and not self.scheduler.waiting:
                    self._wake.clear()
                    if not any(r.abort_reason for r in self.scheduler.running):
                        await self._idle()
            except DeviceLostError as e:
                self.device_lost(str(e))
            except Exception as e:  # never let one bad step kill the worker
                if self.lost is not None:
                    break  # `device_lost` failed every request already
                log.exception("engine step failed; failing the running requests")
                for req in list(self.scheduler.running):
                    self._finish(req, FR.ERROR, error=f"internal error: {e}")

    async def step(self) -> bool:
        """One turn of the loop: requests leave (aborts) and join (admission, then their
        prefill), then one decode step of the running ones. Returns whether there was one."""
        self._reap_aborted()
        await self._gather_arrivals()
        admitted = self.scheduler.admit()
        if admitted:
            await self._prefill(admitted)
            self._flush_outputs()  # first tokens out now, not after the next step
        batch = [r for r in self.scheduler.running if r.pending is not None]
        refreshed = False
        if batch:
            await self._decode(batch)
        elif not (admitted or self.scheduler.waiting or self.scheduler.running):
            refreshed = await self._refresh_answer()
        if admitted or batch:
            self._busy_at = time.monotonic()
        self._flush_outputs(hold=bool(batch))
        self.compiles.check()
        self.metrics.queue(self.scheduler.queue_depth, len(self.scheduler.running))
        return bool(batch) or refreshed

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
                self._finish(req, FR.ABORT, error=req.abort_reason)

    def _flush_outputs(self, *, hold: bool = False) -> None:
        """Each running request's new tokens to its stream. With `hold`, a request that sent
        some less than `stream_interval_s` ago keeps them for a later step: every message costs
        this loop, the gateway and the client CPU time at the moment the next pass starts (an
        8-row step's messages delayed its forward by ~1 ms on 2 cores). A request that reasons
        (a reasoning end marker) is never held: the gateway counts its reasoning tokens by
        message, up to the one that ends the reasoning."""
        now = time.monotonic()
        interval = self.config.stream_interval_s
        for req in self.scheduler.running:
            held = hold and req.sent_at and not req.reasoning_end_marker
            if held and now - req.sent_at < interval:
                continue
            delta = req.delta()
            if delta is not None:
                req.sent_at = now
                req.outputs.put_nowait(delta)

    # ------------------------------------------------------------------ prefill
    async def _prefill(self, reqs: list[Request]) -> None:
        """Grammar first step (its forced tokens streamed at once), then one forward over prompt
        + forced tokens, then sample."""
        started = time.perf_counter()
        answers = await first_step(self.grammar, reqs)
        rows, shared = self._prefill_rows(reqs, answers)
        if not rows:
            return
        # The grammar's forced prefix (`{"name": "` of a JSON schema) is output already: stream it
        # now rather than after the prefill pass, the longest wait of a request's first token.
        self._flush_outputs()
        # Reused prefixes held by another slot are copied first, in admission order (a slot
        # copied from may be the destination of a later copy).
        copies = [
            (r.req.reuse.source, r.req.slot, r.start) for r in rows if r.req.reuse.source >= 0
        ]
        logits = await self.stage.forward(ForwardBatch(rows, "prefill", copies))
        reused = sum(row.start for row in rows)
        prompts = sum(len(row.req.prompt) for row in rows)
        self.metrics.prompt_tokens(computed=prompts - reused, reused=reused)
        if shared:
            logits = await self.stage.share(logits, rows, shared)
            rows += [row for row, _ in shared]
        for row in rows:
            row.req.cached = row.start + len(row.tokens)
            row.req.cached_prompt = row.start
            self.scheduler.prefixes.hold(row.req.slot, row.req.prompt)
        await self._sample([Draw(row.req) for row in rows], logits, answers)
        log.debug(
            "prefill of %d requests took %.1f ms", len(rows), 1e3 * (time.perf_counter() - started)
        )

    def _prefill_rows(
        self, reqs: list[Request], answers: Answers
    ) -> tuple[list[Row], list[tuple[Row, Row]]]:
        """The grammar's answers applied; a row of prompt + forced tokens per live request.
        n > 1: the first choice of a call prefills; the others, (follower, leader) in the
        second list, copy its K/V and logits."""
        rows: list[Row] = []
        leaders: dict[str, tuple[Row, list[int]]] = {}  # by call: its row and prompt + forced
        shared: list[tuple[Row, Row]] = []
        for req in reqs:
            ff = self.ledger.apply_answer(req, answers.get(req))
            if ff is None:
                continue
            tokens = req.prompt + ff
            leader = leaders.get(req.group) if req.group else None
            if leader is not None and leader[1] == tokens:
                # Same prompt and forced tokens: no forward of its own.
                shared.append((Row(req, leader[0].tokens, leader[0].start), leader[0]))
                continue
            row = Row(req, tokens[req.reuse.length :], req.reuse.length)
            rows.append(row)
            if req.group:
                leaders.setdefault(req.group, (row, tokens))
        return rows, shared

    async def _idle(self) -> None:
        """Nothing to run: wait for a request; with a finished answer to refresh, at most until
        the worker has been idle `prefix_refresh_idle_s`. A request still opening its grammar
        is about to be queued: no refresh pass until it is (its submit wakes the loop)."""
        if self._opening or self.scheduler.refresh(self.config.prefix_refresh_tokens) is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self._until_refresh())

    def _until_refresh(self) -> float:
        """Seconds until the worker has been idle `prefix_refresh_idle_s` (0: it has)."""
        idle = time.monotonic() - self._busy_at
        return max(0.0, self.config.prefix_refresh_idle_s - idle)

    async def _refresh_answer(self) -> bool:
        """Idle long enough: one prompt pass over part of a finished answer, so that its slot
        holds it for the conversation's next turn (`PrefixCache.refresh`). A client that sends
        its next request at once (a pipeline, a benchmark) finds the worker free: the passes
        wait until it has been idle `prefix_refresh_idle_s`. Returns whether one ran."""
        todo = self.scheduler.refresh(self.config.prefix_refresh_tokens)
        if todo is None or self._opening or self._until_refresh() > 0:
            return False
        slot, start, tokens = todo
        started = time.perf_counter()
        # The pass writes the slot's K/V; no request owns the slot, and nothing samples.
        owner = Request("", [], Sampling(), Detokenizer(lambda _: b""), slot=slot)
        await self.stage.forward(ForwardBatch([Row(owner, tokens, start)], "refresh"))
        log.debug(
            "refreshed answer tokens %d-%d of slot %d in %.1f ms",
            start,
            start + len(tokens),
            slot,
            1e3 * (time.perf_counter() - started),
        )
        self.scheduler.prefixes.refreshed(slot, len(tokens))
        self.metrics.refreshed(len(tokens))
        return True

    # ------------------------------------------------------------------ decode
    async def _decode(self, batch: list[Request]) -> None:
        """One decode step: plan drafts; a speculative step when some row has drafts worth
        verifying or may get forced ones (`Speculator.applies`), else a plain step on one of
        its three schedules: plain when no row is constrained, serial when overlap is off,
        else overlapped."""
        spec = self.speculator
        drafts = spec.plan(batch) if spec is not None else {}
        started = time.perf_counter()
        if spec is not None and spec.applies(batch, drafts):
            width = await self._speculate(batch, drafts)
        else:
            call = send_step(self.grammar, batch, self.metrics)
            if call is None:
                width = await self._decode_plain(batch)
            elif not self.config.overlap:
                width = await self._decode_serial(batch, call)
            else:
                width = await self._decode_overlapped(batch, call)
        elapsed = time.perf_counter() - started
        self.metrics.step(elapsed, len(batch))
        if spec is not None:
            spec.record(len(batch), width, elapsed)

    async def _decode_plain(self, batch: list[Request]) -> int:
        """No row is constrained: forward the pending tokens and sample, in one device call.
        Returns the tokens forwarded (as every step stage does)."""
        rows = [Row(r, [_pending(r)], r.cached) for r in batch]
        draws: list[Draw | None] = [Draw(r) for r in batch]
        sampled = await self.stage.forward_and_sample(ForwardBatch(rows, "decode"), draws, {})
        for r in batch:
            r.cached += 1
            r.pending = None
        self.ledger.accept_draws(draws, sampled)
        return len(rows)

    async def _decode_overlapped(self, batch: list[Request], call: GrammarCall) -> int:
        """Forward the pending tokens while the grammar's answers (if any) are computed; then
        forced tokens go through the model in one jump-forward pass whose last position's
        logits replace their row's; then sample."""
        rows = [Row(r, [_pending(r)], r.cached) for r in batch]
        logits = await self.stage.forward(ForwardBatch(rows, "decode"))
        answers = await call.answers()
        ff_rows: list[Row] = []
        for r in batch:
            r.cached += 1
            r.pending = None
            ff = self.ledger.apply_answer(r, answers.get(r))
            if ff:
                ff_rows.append(Row(r, ff, r.cached))
        if ff_rows:
            logits = await self.stage.jump_forward(logits, ff_rows, batch)
            for row in ff_rows:
                row.req.cached += len(row.tokens)
        # A request that left keeps its logits row; its draw is a padding row, ignored.
        draws = [None if r.finished else Draw(r) for r in batch]
        if any(d is not None for d in draws):
            await self._sample(draws, logits, answers)
        return len(rows) + sum(len(row.tokens) for row in ff_rows)

    async def _decode_serial(self, batch: list[Request], call: GrammarCall) -> int:
        """The grammar's answers first, then one forward of pending + forced tokens for every
        live row, then sample."""
        answers = await call.answers()
        rows: list[Row] = []
        for r in batch:
            pending = _pending(r)
            r.pending = None
            ff = self.ledger.apply_answer(r, answers.get(r))
            if ff is not None:
                rows.append(Row(r, [pending, *ff], r.cached))
        if not rows:
            return 0
        draws: list[Draw | None] = [Draw(row.req) for row in rows]
        sampled = await self.stage.forward_and_sample(ForwardBatch(rows, "decode"), draws, answers)
        for row in rows:
            row.req.cached += len(row.tokens)
        self.ledger.accept_draws(draws, sampled)
        return sum(len(row.tokens) for row in rows)

    async def _speculate(self, batch: list[Request], drafts: Drafts) -> int:
        """A step with drafts (`neuron_worker.speculator`): the grammar checks them first (their
        rejected tail never reaches the device), one forward verifies every kept draft, the
        sampler draws a token at every position but a forced draft's, and each request keeps
        its drafts up to the first the sampler disagrees with. Returns the tokens forwarded."""
        spec = self.speculator
        assert spec is not None
        call = send_step(
            self.grammar, batch, self.metrics, drafts=drafts, forced_room=spec.forced_room
        )
        answers = await call.answers() if call is not None else {}
        rows = spec.rows(batch, drafts, answers)
        if not rows:
            return 0
        draws = [p for row in rows for p in row.positions()]
        spec.commit(
            rows, await self.stage.forward_and_sample(ForwardBatch(rows, "verify"), draws, answers)
        )
        return sum(len(row.tokens) for row in rows)

    async def _sample(self, draws: list[Draw | None], logits: Logits, answers: Answers) -> None:
        """Sample one token per draw and act on it (`Ledger.accept_draws`)."""
        self.ledger.accept_draws(draws, await self.stage.sample(draws, logits, answers))

    # ------------------------------------------------------------------ warm-up
    async def warmup(self, on_graph: Callable[[str], None] | None = None) -> int:
        """Compile every graph shape the step loop can produce (`DeviceStage.warmup`); returns
        the number of graphs."""
        return await self.stage.warmup(on_graph)
