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
"""

from __future__ import annotations

import time

import grpc
import numpy as np
from google.rpc import status_pb2

from grammar_service import metrics
from grammar_service.backend import RequestGrammar
from grammar_service.compiler import CompiledGrammar
from grammar_service.masks import MaskBuffer
from grammar_service.reasoning import ReasoningGate
from grammar_service.runtime import Runtime
from grammar_service.schema.monitor import Ahead, Monitor, token_classes
from maskwire.bitmask import encode_rows
from maskwire.rpc import RpcError, status_proto
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import grammar_pb2

# Bytes of forced text looked at per forced draft (`StepRow.forced_draft_room`).
_MAX_TOKEN_BYTES = 32
OK = grammar_pb2.ROW_STATUS_OK
DESYNC = grammar_pb2.ROW_STATUS_DESYNC
ERROR = grammar_pb2.ROW_STATUS_ERROR
UNKNOWN = grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST
_STATUS_NAMES = {v: grammar_pb2.RowStatus.Name(v) for v in (OK, DESYNC, ERROR, UNKNOWN)}
# A stream whose last step took longer than this runs its next one on a worker thread. Fast steps
# stay on the event loop: the hand-off costs ~25 µs, a third of a typical one-row step.
OFFLOAD_AFTER_S = 0.002
# Replays longer than this many tokens run on a worker thread.
OFFLOAD_REPLAY_TOKENS = 64
# Tokens consumed per call when a long run (replay, forced tokens) is checked against its budget.
_CHUNK = 32


def _forced_tail(
    g: RequestGrammar, drafts: list[int], room: int, tok: Tokenizer, jump_forward: bool
) -> tuple[list[int], int, int] | None:
    """`drafts` (all valid) extended by what the grammar forces once they are consumed (the
    next key after drafts that close a JSON string), as a step without speculation would
    produce it: the last draft re-tokenized with the forced bytes after it as the model
    writes them (`"` then `, "city": "` is `",`), the tokens jump-forward forces after that
    (` "` `city` `":`), then drafts of the bytes forced beyond them (` "`). Returns the drafts
    and where the forced tokens start among them and how many there are; None when nothing is
    forced there or more than `room` drafts would be added. The state is unchanged."""
    if not g.consume(drafts):
        return None  # not reached: the drafts were just validated
    try:
        forced = g.ff_bytes()
    finally:
        g.rollback(len(drafts))
    if not forced:
        return None
    head = drafts[:-1]
    last = tok.ll.tokenize_bytes(tok.token_bytes(drafts[-1]) + forced[:_MAX_TOKEN_BYTES])[0]
    # Checked before it is consumed: a token the grammar refuses would leave it in error.
    if g.validate_drafts([*head, last]) < len(drafts) or not g.consume([*head, last]):
        return None
    consumed = len(drafts)
    try:
        jump = g.ff_tokens() if jump_forward else []
        if len(jump) > room or (jump and not g.consume(jump)):
            return None
        consumed += len(jump)
        rest = g.ff_bytes()[: room * _MAX_TOKEN_BYTES]
        beyond = tok.ll.tokenize_bytes(rest)[: room - len(jump)] if rest else []
    finally:
        g.rollback(consumed)
    return [*head, last, *jump, *beyond], len(drafts), len(jump)


class Request:
    """One live request: its grammar, token count, options and output check."""

    __slots__ = ("dead", "gate", "grammar", "jump_forward", "monitor", "position", "request_id")

    def __init__(
        self,
        request_id: str,
        grammar: RequestGrammar,
        jump_forward: bool,
        gate: ReasoningGate | None,
        monitor: Monitor | None = None,
    ) -> None:
        self.request_id = request_id
        self.grammar = grammar
        self.jump_forward = jump_forward
        self.gate = gate
        self.monitor = monitor
        self.position = 0
        self.dead: status_pb2.Status | None = None


def _row_error(message: str, reason: str) -> status_pb2.Status:
    return status_proto(grpc.StatusCode.INVALID_ARGUMENT, message, reason=reason)


class Session:
    """The state of one stream. `handle` answers one SessionRequest."""

    def __init__(self, runtime: Runtime, client: str = "") -> None:
        self.runtime = runtime
        self.client = client  # who holds the stream (its compiles share the sandbox fairly)
        self.requests: dict[str, Request] = {}
        self._opening = 0  # Opens holding a live-request slot while they compile or replay
        self.tokenizer: Tokenizer | None = None
        self._buffer: MaskBuffer | None = None
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
        if rid in self.requests:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {rid!r} is already open on this stream",
                [("open.request_id", "duplicate of a live request")],
                reason="DUPLICATE_REQUEST",
            )
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
            kind = msg.WhichOneof("grammar")
            if kind == "constraint":
                compiled, _ = await rt.compile(msg.constraint, tok, self.client)
            elif kind == "grammar_id":
                found = rt.cached(msg.grammar_id)
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
                compiled = found
            else:
                raise RpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "Open needs a constraint or a grammar_id",
                    [("open.grammar", "set constraint or grammar_id")],
                )
            if rid in self.requests:  # re-check: another Open may have run during the compile
                raise RpcError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request {rid!r} is already open on this stream",
                    [("open.request_id", "duplicate of a live request")],
                    reason="DUPLICATE_REQUEST",
                )
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
        return req.position, compiled

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
        ok, spent = _consume_within(req.grammar, rest, budget)
        if not ok and spent > budget:
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
        t_start = time.perf_counter()
        rows = msg.rows
        n = len(rows)
        tok = self.tokenizer
        out = grammar_pb2.StepResult(step=msg.step)
        if tok is None or self._buffer is None:
            # Nothing was ever opened here: every row is unknown.
            out.words_per_row = self.runtime.default_tokenizer.words_per_row
            for row in rows:
                out.rows.add(
                    request_id=row.request_id,
                    status=UNKNOWN,
                    error=_unknown(row.request_id),
                )
            return out
        if n > self.runtime.limits.max_rows_per_step:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Step has {n} rows; this service accepts at most "
                f"{self.runtime.limits.max_rows_per_step} (--max-rows-per-step)",
                [("step.rows", "too many rows")],
            )
        vocab = tok.vocab_size
        requests = self.requests
        backend = self.runtime.backend
        max_drafts = self.runtime.limits.max_drafts_per_row
        budget = self.runtime.limits.max_request_step_s
        audit = self._audit
        # CPU seconds of grammar work per row, for the work done for that row alone.
        spent = [0.0] * n
        batched_s = 0.0  # wall time of the calls that do many rows at once

        # Phase 1: check every row, feed reasoning gates, collect grammar tokens.
        # state[i]: the Request when the row is OK so far, else None (result already decided).
        # The loops below run once per row of every step: they read each protobuf field once
        # and keep the common case (one new token, no drafts, no reasoning gate) short.
        rids = [row.request_id for row in rows]
        state: list[Request | None] = [None] * n
        status = [OK] * n
        errors: list[status_pb2.Status | None] = [None] * n
        expected = [0] * n
        drafts_of: dict[int, list[int]] = {}
        forced_room: dict[int, int] = {}  # StepRow.forced_draft_room, where set
        singles: list[tuple[RequestGrammar, int]] = []
        single_idx: list[int] = []
        seen: set[str] = set()
        for i, row in enumerate(rows):
            rid = rids[i]
            req = requests.get(rid)
            if req is None:
                status[i] = UNKNOWN
                errors[i] = _unknown(rid)
                continue
            if rid in seen:
                status[i] = ERROR
                errors[i] = _row_error(
                    f"request {rid!r} appears more than once in step {msg.step}", "DUPLICATE_ROW"
                )
                continue
            seen.add(rid)
            if req.dead is not None:
                status[i] = ERROR
                errors[i] = req.dead
                continue
            new = list(row.new_tokens)
            k = len(new)
            want = req.position + k
            if row.position != want:
                status[i] = DESYNC
                expected[i] = want
                continue
            if k and (min(new) < 0 or max(new) >= vocab):
                bad = next(t for t in new if not 0 <= t < vocab)
                self._kill(req, f"token {bad} is out of range [0, {vocab})", "TOKEN_OUT_OF_RANGE")
                status[i] = ERROR
                errors[i] = req.dead
                continue
            req.position = want
            state[i] = req
            drafts = row.draft_tokens
            if drafts:
                drafts_of[i] = list(drafts[:max_drafts])
            if row.forced_draft_room:
                forced_room[i] = min(row.forced_draft_room, max_drafts)
            if k == 0:
                continue
            gate = req.gate
            if gate is not None and not gate.done:
                skip = gate.feed(new, tok.token_bytes)
                if skip == k:
                    continue
                new = new[skip:]
            elif k == 1:
                singles.append((req.grammar, new[0]))
                single_idx.append(i)
                continue
            ok, spent[i] = _consume_within(req.grammar, new, budget)
            if not ok:
                self._kill_consumer(req, spent[i], budget)
            if ok and not self._watch(req, new, spent, i):
                ok = False
            if not ok:
                status[i] = ERROR
                errors[i] = req.dead
                state[i] = None

        # Phase 2: the common case, one new token per row, in one batched call (row by row,
        # timed, in an audit step).
        if singles:
            if audit:
                oks = []
                for j, pair in enumerate(singles):
                    t0 = time.thread_time()
                    oks += backend.consume_each([pair])
                    spent[single_idx[j]] += time.thread_time() - t0
            else:
                t0 = time.perf_counter()
                oks = backend.consume_each(singles)
                batched_s += time.perf_counter() - t0
            for j, ok in enumerate(oks):
                i = single_idx[j]
                req = state[i]
                assert req is not None
                if not ok:
                    self._kill_by_grammar(req)
                elif req.monitor is None or self._watch(req, [singles[j][1]], spent, i):
                    continue
                status[i] = ERROR
                errors[i] = req.dead
                state[i] = None

        # Phase 3: jump-forward, drafts, mask slots.
        ff: dict[int, list[int]] = {}
        accepting: dict[int, bool] = {}  # what the output check says, for checked rows
        ahead: dict[int, list[Ahead]] = {}  # checked rows: the output after each accepted draft
        forced_drafts: dict[int, list[int]] = {}  # drafts of the forced bytes (forced_draft_room)
        forced_jump: dict[int, tuple[int, int]] = {}  # where forced tokens are among them
        accepted = [0] * n
        slots = [-1] * n
        plain: list[tuple[RequestGrammar, int]] = []
        drafted: list[tuple[RequestGrammar, int, list[int]]] = []
        cursor = 0
        for i in range(n):
            req = state[i]
            if req is None:
                continue
            gate = req.gate
            if gate is not None and not gate.done:
                d = drafts_of.get(i)
                if d:
                    accepted[i] = self._reasoning_drafts(req, d, tok)
                continue
            g = req.grammar
            if req.jump_forward:
                t0 = time.thread_time()
                forced = g.ff_tokens()
                spent[i] += time.thread_time() - t0
                if forced:
                    ok = self._forced_ok(req, forced, spent, i)
                    if ok:
                        ok, dt = _consume_within(g, forced, budget)
                        spent[i] += dt
                        if not ok:
                            self._kill_consumer(req, spent[i], budget)
                    if ok and not self._watch(req, forced, spent, i):
                        ok = False
                    if not ok:
                        status[i] = ERROR
                        errors[i] = req.dead
                        state[i] = None
                        continue
                    req.position += len(forced)
                    ff[i] = forced
                    if i in forced_room:
                        # The worker drafted without knowing `forced`: its drafts would not
                        # follow them. Draft what the grammar forces beyond them instead.
                        t0 = time.thread_time()
                        room = forced_room[i]
                        # A long forced literal: tokenize no more than the drafts can use.
                        tail = g.ff_bytes()[: room * _MAX_TOKEN_BYTES]
                        d = tok.ll.tokenize_bytes(tail)[:room] if tail else []
                        spent[i] += time.thread_time() - t0
                        forced_drafts[i] = drafts_of[i] = d
            if i in drafts_of:
                d = drafts_of[i]
                cut = next((j for j, t in enumerate(d) if not 0 <= t < vocab), len(d))
                t0 = time.thread_time()
                a = g.validate_drafts(d[:cut]) if cut else 0
                if d and a == len(d) and i in forced_room and i not in forced_drafts:
                    extended = _forced_tail(g, d, forced_room[i], tok, req.jump_forward)
                    if extended is not None:
                        d, at, count = extended
                        a = g.validate_drafts(d)
                        forced_drafts[i] = drafts_of[i] = d
                        forced_jump[i] = (at, count)
                if a and req.monitor is not None:  # and the output check, draft by draft
                    ahead[i] = req.monitor.ahead(d[:a])
                    a = len(ahead[i])
                spent[i] += time.thread_time() - t0
                accepted[i] = a
                if a:
                    slots[i] = cursor
                    drafted.append((g, cursor, d[:a]))
                    cursor += 1 + a
                    continue
            slots[i] = cursor
            plain.append((g, cursor))
            cursor += 1

        # Phase 4: fill every mask row of the step in one or two executor calls.
        buf = self._buffer
        if cursor:
            buf.reserve(cursor)
            t_fill = time.perf_counter()
            if audit:
                self._fill_each(
                    plain, drafted, buf, spent, slot_row={s: i for i, s in enumerate(slots)}
                )
            else:
                backend.fill(plain, drafted, buf.ptr, buf.one_mask_bytes, buf.capacity)
                batched_s += time.perf_counter() - t_fill
            metrics.MASK_SECONDS_PER_ROW.observe((time.perf_counter() - t_fill) / cursor)
            cursor = self._check_outputs(
                state, status, errors, slots, accepted, accepting, ahead, spent, cursor
            )
        if cursor:
            if msg.compact_masks and cursor >= self.runtime.limits.compact_min_rows:
                c = encode_rows(buf.rows(cursor), vocab)
                out.bitmask = c.dense
                out.mask_row_encodings.extend(c.encodings.tolist())
                out.mask_row_word_counts.extend(c.counts.tolist())
                out.mask_word_index = c.index
                out.mask_word_values = c.values
                out.mask_row_repeat_of.extend(c.repeat_of.tolist())
            else:
                out.bitmask = buf.tobytes(cursor)
        out.words_per_row = buf.words_per_row
        out.vocab_size = vocab

        # Phase 5: the answer.
        add = out.rows.add
        for i in range(n):
            req = state[i]
            if req is not None:
                if slots[i] < 0:  # unconstrained (reasoning): no mask row
                    add(
                        request_id=rids[i],
                        status=OK,
                        accepted_drafts=accepted[i],
                        position=req.position,
                    )
                    continue
                g = req.grammar
                r = add(
                    request_id=rids[i],
                    status=OK,
                    mask_rows=1 + accepted[i],
                    accepted_drafts=accepted[i],
                    position=req.position,
                    accepting=accepting.get(i, g.is_accepting()),
                    finished=g.is_stopped(),
                )
                if i in ff:
                    r.ff_tokens.extend(ff[i])
                if i in forced_drafts:
                    r.forced_drafts.extend(forced_drafts[i][: accepted[i]])
                if i in forced_jump:
                    at, count = forced_jump[i]
                    r.forced_jump_start = at
                    r.forced_jump_count = max(0, min(count, accepted[i] - at))
                continue
            st = status[i]
            rid = rids[i]
            if st == DESYNC:
                add(
                    request_id=rid,
                    status=DESYNC,
                    position=requests[rid].position,
                    expected_position=expected[i],
                )
            else:
                real_req = requests.get(rid)
                add(
                    request_id=rid,
                    status=st,
                    position=real_req.position if real_req is not None else 0,
                    error=errors[i],
                )
        self._enforce_budget(state, spent, budget, audit, batched_s)
        metrics.ROWS_PER_STEP.observe(n)
        self.last_step_s = time.perf_counter() - t_start
        metrics.STEP_SECONDS.observe(self.last_step_s)
        return out

    # -- the output check -------------------------------------------------------------------
    def _watch(self, req: Request, tokens: list[int], spent: list[float], i: int) -> bool:
        """Feed consumed tokens to the request's output check. False (the request is dead) when
        they complete a value that violates the schema: the mask did not allow them."""
        if req.monitor is None:
            return True
        t0 = time.thread_time()
        err = req.monitor.feed(tokens)
        spent[i] += time.thread_time() - t0
        if err is None:
            return True
        if req.monitor.cut_short:  # the mask allowed it untried (the check ran out of time)
            self._unsatisfied(req, f"the output violates the schema: {err}")
        else:
            self._kill(req, f"the token violates the schema: {err}", "TOKEN_REJECTED")
        return False

    def _forced_ok(self, req: Request, forced: list[int], spent: list[float], i: int) -> bool:
        """Whether the tokens the grammar forces keep the output valid; when they cannot, no
        continuation can, and the request ends unsatisfied."""
        if req.monitor is None:
            return True
        t0 = time.thread_time()
        err = req.monitor.try_tokens(forced)
        spent[i] += time.thread_time() - t0
        if err is None:
            return True
        self._unsatisfied(req, f"the grammar forces text that violates the schema: {err}")
        return False

    def _check_outputs(
        self,
        state: list[Request | None],
        status: list[grammar_pb2.RowStatus],
        errors: list[status_pb2.Status | None],
        slots: list[int],
        accepted: list[int],
        accepting: dict[int, bool],
        ahead: dict[int, list[Ahead]],
        spent: list[float],
        cursor: int,
    ) -> int:
        """Apply the output checks to the filled mask rows of checked requests. A request whose
        main row is left empty fails now; one whose row after a draft is left empty accepts
        only the drafts before it. Rows that leave the answer are removed; returns the new row
        count."""
        assert self._buffer is not None
        rows = self._buffer.rows(cursor)
        drop: set[int] = set()
        for i, req in enumerate(state):
            if req is None or req.monitor is None or slots[i] < 0:
                continue
            if not req.monitor.tracked and i not in ahead and not req.grammar.is_accepting():
                continue  # validation only: nothing to do until the output can end
            t0 = time.thread_time()
            slot = slots[i]
            ok, masked = req.monitor.filter(rows[slot].view(np.uint32))
            left = bool(rows[slot].any())
            for j, view in enumerate(ahead.get(i, [])[: accepted[i]]):
                _, more = req.monitor.filter(rows[slot + 1 + j].view(np.uint32), view)
                masked += more
                if not rows[slot + 1 + j].any():  # that draft leads nowhere valid
                    drop.update(range(slot + 1 + j, slot + 1 + accepted[i]))
                    accepted[i] = j
                    break
            spent[i] += time.thread_time() - t0
            metrics.SCHEMA_TOKENS_MASKED.inc(masked)
            accepting[i] = ok
            if left and (ok or not req.grammar.is_stopped()):
                continue
            why = req.monitor.document_error() if req.grammar.is_accepting() else None
            self._unsatisfied(
                req,
                f"the output is complete but does not validate: {why}"
                if why
                else "no token keeps the output valid against the schema",
            )
            status[i] = ERROR
            errors[i] = req.dead
            state[i] = None
            drop.update(range(slot, slot + 1 + accepted[i]))
        if not drop:
            return cursor
        keep = [r for r in range(cursor) if r not in drop]
        rows[: len(keep)] = rows[keep]
        new_slot = {old: new for new, old in enumerate(keep)}
        for i, slot in enumerate(slots):
            if slot >= 0:
                slots[i] = new_slot.get(slot, -1)
        return len(keep)

    def _unsatisfied(self, req: Request, why: str) -> None:
        metrics.SCHEMA_UNSATISFIED.inc()
        self._kill(req, f"constraint could not be satisfied: {why}", "CONSTRAINT_UNSATISFIABLE")

    def _fill_each(
        self,
        plain: list[tuple[RequestGrammar, int]],
        drafted: list[tuple[RequestGrammar, int, list[int]]],
        buf: MaskBuffer,
        spent: list[float],
        slot_row: dict[int, int],
    ) -> None:
        """An audit step's mask fill: one call per request, each timed against its row."""
        backend = self.runtime.backend
        for g, slot in plain:
            t0 = time.thread_time()
            backend.fill([(g, slot)], [], buf.ptr, buf.one_mask_bytes, buf.capacity)
            spent[slot_row[slot]] += time.thread_time() - t0
        for g, slot, d in drafted:
            t0 = time.thread_time()
            backend.fill([], [(g, slot, d)], buf.ptr, buf.one_mask_bytes, buf.capacity)
            spent[slot_row[slot]] += time.thread_time() - t0

    def _enforce_budget(
        self,
        state: list[Request | None],
        spent: list[float],
        budget: float,
        audit: bool,
        batched_s: float,
    ) -> None:
        """Fail (from their next step) the requests whose work passed the budget; audit the next
        step when batched work was too slow to tell whose it was."""
        over = False
        for i, req in enumerate(state):
            if req is not None and spent[i] > budget:
                over = True
                self._kill_expensive(req, spent[i], budget)
        self._audit = (not audit and batched_s > budget) or (audit and over)

    def _kill_consumer(self, req: Request, spent: float, budget: float) -> None:
        """A run of tokens was not consumed: rejected by the grammar, or cut at the budget."""
        if spent > budget:
            self._kill_expensive(req, spent, budget)
        else:
            self._kill_by_grammar(req)

    def _kill_expensive(self, req: Request, spent: float, budget: float) -> None:
        metrics.BUDGET_KILLS.inc()
        self._kill(
            req,
            f"the grammar took {spent * 1e3:.0f} ms of work in one step for this request "
            f"(limit {budget * 1e3:g} ms, --max-request-step-ms): it is too ambiguous or too "
            "expensive to follow",
            "GRAMMAR_TOO_EXPENSIVE",
        )

    def _reasoning_drafts(self, req: Request, drafts: list[int], tok: Tokenizer) -> int:
        """Unconstrained drafts are all acceptable, up to (not including) the one that would end
        the reasoning part: the position after it needs a constrained mask row."""
        vocab = tok.vocab_size
        cut = next((j for j, t in enumerate(drafts) if not 0 <= t < vocab), len(drafts))
        assert req.gate is not None
        end = req.gate.would_end(drafts[:cut], tok.token_bytes)
        return cut if end is None else end

    def _kill(self, req: Request, message: str, reason: str) -> None:
        req.dead = _row_error(message, reason)

    def _kill_by_grammar(self, req: Request) -> None:
        err = req.grammar.error() or "the grammar rejected the token"
        req.dead = _row_error(err, "TOKEN_REJECTED")


def _consume_within(
    grammar: RequestGrammar, tokens: list[int], budget_s: float
) -> tuple[bool, float]:
    """Consume `tokens` in chunks until done, rejected, or past `budget_s` of this thread's CPU
    time (llguidance holds the GIL for a whole call: chunks keep each call short). Returns
    (every token accepted, CPU seconds spent); past the budget the rest is left unconsumed, and
    the spent time says so."""
    t0 = time.thread_time()
    for at in range(0, len(tokens), _CHUNK):
        if not grammar.consume(tokens[at : at + _CHUNK]):
            return False, time.thread_time() - t0
        if time.thread_time() - t0 > budget_s and at + _CHUNK < len(tokens):
            return False, time.thread_time() - t0
    return True, time.thread_time() - t0


def _unknown(rid: str) -> status_pb2.Status:
    return status_proto(
        grpc.StatusCode.NOT_FOUND,
        f"no live request {rid!r} on this stream",
        reason="UNKNOWN_REQUEST",
    )
