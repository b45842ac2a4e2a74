"""One Session stream's protocol state machine: Open / Step / Close (see docs/protocol.md).

Pure: no gRPC here. Every per-request problem becomes data in `Opened.error` / `RowResult`; only
misuse of this class raises. A stream's requests share one tokenizer (the first `Open` fixes it),
so every row of a `StepResult` has the same width.

Requests constrained by a JSON schema in complete mode have an output check (`schema.monitor`):
it follows their consumed tokens, masks off tokens that would complete a value violating the
original schema, and allows end-of-sequence only when the output validates; a request left with
no allowed token ends with `CONSTRAINT_UNSATISFIABLE`. Its time counts towards the request's
budget.

Grammar work has a budget per request (`Limits.max_request_step_s` of CPU time per step,
`max_replay_s` per replay): an ambiguous grammar can make one request's parser work grow without
bound, and the steps of every other request on the stream would wait for it. Work done for one
request alone is timed as it runs; when a step's batched calls take longer than one request's
budget, the next step is an *audit* step that does every row on its own and times it. A request
over budget fails at its next step (`GRAMMAR_TOO_EXPENSIVE`); the others go on.

A step's phases are in `grammar_service.step`; drafts and the forced tail in
`grammar_service.drafts`.
"""

from __future__ import annotations

import time

import grpc

from grammar_service import metrics
from grammar_service.budget import CpuMeter, consume_within
from grammar_service.compiler import CompiledGrammar
from grammar_service.drafts import Drafter
from grammar_service.masks import MaskBuffer
from grammar_service.reasoning import ReasoningGate
from grammar_service.request import Request, unknown_request
from grammar_service.runtime import Runtime
from grammar_service.schema.monitor import Monitor, token_classes
from grammar_service.step import UNKNOWN, StepWork
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import grammar_pb2

# A stream whose last step took longer than this runs its next one on a worker thread. Fast steps
# stay on the event loop: the hand-off costs ~25 µs, a third of a typical one-row step.
OFFLOAD_AFTER_S = 0.002
# Replays longer than this many tokens run on a worker thread.
OFFLOAD_REPLAY_TOKENS = 64


class Session:
    """The state of one stream. `handle` answers one SessionRequest."""

    def __init__(self, runtime: Runtime, client: str = "") -> None:
        self.runtime = runtime
        self.client = client  # who holds the stream (its compiles share the sandbox fairly)
        self.requests: dict[str, Request] = {}
        self._opening = 0  # Opens holding a live-request slot while they compile or replay
        self.tokenizer: Tokenizer | None = None
        self._buffer: MaskBuffer | None = None
        self._drafter: Drafter | None = None
        self._audit = False  # do the next step row by row, timing each request
        self.last_step_s = 0.0  # wall time of the last step (the servicer offloads slow ones)

    # -- dispatch ---------------------------------------------------------------------------
    async def handle(self, msg: grammar_pb2.SessionRequest) -> grammar_pb2.SessionResponse:
        kind = msg.WhichOneof("kind")
        if kind == "step":
            if self.last_step_s < OFFLOAD_AFTER_S:
                result = self.step(msg.step)
            else:  # slow steps leave the event loop free for health checks and other streams
                result = await self.runtime.in_thread(self.step, msg.step)
            return grammar_pb2.SessionResponse(step_result=result)
        if kind == "open":
            return grammar_pb2.SessionResponse(opened=await self.open(msg.open))
        if kind == "close":
            return grammar_pb2.SessionResponse(closed=self.close(msg.close))
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "empty SessionRequest: set open, step or close",
            [("kind", "exactly one of open, step, close")],
        )

    # -- Open -------------------------------------------------------------------------------
    async def open(self, msg: grammar_pb2.Open) -> grammar_pb2.Opened:
        rid = msg.request_id
        try:
            position, compiled = await self._open(msg)
        except RpcError as e:
            return grammar_pb2.Opened(request_id=rid, error=e.to_status())
        return grammar_pb2.Opened(
            request_id=rid,
            warnings=compiled.warnings,
            position=position,
            schema_report=compiled.report,
        )

    async def _open(self, msg: grammar_pb2.Open) -> tuple[int, CompiledGrammar]:
        rid = msg.request_id
        if not rid:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id is required",
                [("open.request_id", "must not be empty")],
            )
        self._check_new(rid)
        rt = self.runtime
        tok = rt.tokenizer_for(msg.tokenizer, field="open.tokenizer", required=True)
        if self.tokenizer is not None and tok is not self.tokenizer:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this stream's requests use tokenizer {self.tokenizer.fingerprint.short()}; "
                "open requests for another tokenizer on another stream",
                [("open.tokenizer", "differs from the tokenizer of this stream's other requests")],
                reason="TOKENIZER_MISMATCH",
            )
        rt.acquire_request(len(self.requests) + self._opening)  # fail fast before compiling
        self._opening += 1
        try:
            compiled = await self._grammar(msg, tok)
            self._check_new(rid)  # again: another Open may have run during the compile
            marker = msg.options.reasoning_end_marker.encode()
            req = Request(
                rid,
                rt.backend.new_request(compiled),
                bool(msg.options.jump_forward),
                ReasoningGate(marker) if marker else None,
                Monitor(compiled.checks, token_classes(tok)) if compiled.checks else None,
            )
            replay = list(msg.replay_tokens)
            if len(replay) > OFFLOAD_REPLAY_TOKENS:
                await rt.in_thread(self._replay, req, replay, tok)
            elif replay:
                self._replay(req, replay, tok)
        except BaseException:
            rt.release_requests(1)
            raise
        finally:
            self._opening -= 1
        self.requests[rid] = req
        if self.tokenizer is None:
            self.tokenizer = tok
            self._buffer = MaskBuffer(tok.words_per_row)
            self._drafter = Drafter(rt.backend, tok)
        return req.position, compiled

    def _check_new(self, rid: str) -> None:
        if rid in self.requests:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {rid!r} is already open on this stream",
                [("open.request_id", "duplicate of a live request")],
                reason="DUPLICATE_REQUEST",
            )

    async def _grammar(self, msg: grammar_pb2.Open, tok: Tokenizer) -> CompiledGrammar:
        """The Open's compiled grammar: its constraint compiled, or its grammar_id found."""
        kind = msg.WhichOneof("grammar")
        if kind == "constraint":
            compiled, _ = await self.runtime.compile(msg.constraint, tok, self.client)
            return compiled
        if kind != "grammar_id":
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Open needs a constraint or a grammar_id",
                [("open.grammar", "set constraint or grammar_id")],
            )
        found = self.runtime.cached(msg.grammar_id)
        if found is None:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"grammar_id {msg.grammar_id!r} is not in this service's compile cache "
                "(evicted, or compiled on another replica): open with the constraint",
                [("open.grammar_id", "unknown or evicted")],
                reason="GRAMMAR_NOT_FOUND",
            )
        if found.tokenizer is not tok:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "grammar_id was compiled for another tokenizer",
                [("open.grammar_id", "compiled for a different tokenizer")],
                reason="TOKENIZER_MISMATCH",
            )
        return found

    def _replay(self, req: Request, tokens: list[int], tok: Tokenizer) -> None:
        vocab = tok.vocab_size
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab:
                raise RpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"replay token {t} at index {i} is out of range [0, {vocab})",
                    [(f"open.replay_tokens[{i}]", "token id out of range")],
                    reason="TOKEN_OUT_OF_RANGE",
                )
        skip = req.gate.feed(tokens, tok.token_bytes) if req.gate is not None else 0
        rest = tokens[skip:]
        budget = self.runtime.limits.max_replay_s
        meter = CpuMeter()
        ok = consume_within(req.grammar, rest, budget, meter)
        if not ok and meter.spent > budget:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replaying {len(rest)} tokens took more than {budget:g}s of grammar work "
                "(--max-replay-ms): the grammar is too expensive",
                [("open.replay_tokens", "grammar too expensive to replay")],
                reason="GRAMMAR_TOO_EXPENSIVE",
            )
        why = req.grammar.error() if not ok else None
        if ok and req.monitor is not None:
            why = req.monitor.feed(rest)
        if why is not None:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replay tokens rejected by the grammar: {why}",
                [("open.replay_tokens", why)],
                reason="REPLAY_REJECTED",
            )
        req.position = len(tokens)

    # -- Close ------------------------------------------------------------------------------
    def close(self, msg: grammar_pb2.Close) -> grammar_pb2.Closed:
        found = self.requests.pop(msg.request_id, None) is not None
        if found:
            self.runtime.release_requests(1)
        return grammar_pb2.Closed(request_id=msg.request_id, found=found)

    def close_all(self) -> int:
        """Free every request of the stream (it ended)."""
        n = len(self.requests)
        self.requests.clear()
        if n:
            self.runtime.release_requests(n)
        return n

    # -- Step -------------------------------------------------------------------------------
    def step(self, msg: grammar_pb2.Step) -> grammar_pb2.StepResult:
        """Advance every row's request by its new tokens and answer with its next mask rows
        (phase by phase: `grammar_service.step`)."""
        t_start = time.perf_counter()
        if self._drafter is None or self._buffer is None:
            return self._unknown_step(msg)
        limit = self.runtime.limits.max_rows_per_step
        if len(msg.rows) > limit:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Step has {len(msg.rows)} rows; this service accepts at most {limit} "
                "(--max-rows-per-step)",
                [("step.rows", "too many rows")],
            )
        work = StepWork(self.runtime, self.requests, self._drafter, self._buffer, self._audit, msg)
        work.check()
        work.consume()
        work.advance()
        work.fill()
        work.check_outputs()
        out = work.answer()
        self._audit = work.settle_budgets()
        metrics.ROWS_PER_STEP.observe(len(msg.rows))
        self.last_step_s = time.perf_counter() - t_start
        metrics.STEP_SECONDS.observe(self.last_step_s)
        return out

    def _unknown_step(self, msg: grammar_pb2.Step) -> grammar_pb2.StepResult:
        """Nothing was ever opened here: every row is unknown."""
        out = grammar_pb2.StepResult(step=msg.step)
        out.words_per_row = self.runtime.default_tokenizer.words_per_row
        for row in msg.rows:
            out.rows.add(
                request_id=row.request_id, status=UNKNOWN, error=unknown_request(row.request_id)
            )
        return out
