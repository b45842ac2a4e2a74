"""One `Step` on one stream, phase by phase, over a record per row (`Session.step` runs them).

1. `check`: each row's request, position and tokens; reasoning gates fed; rows of several new
   tokens consumed at once.
2. `consume`: the common case, one new token per row, in one batched backend call.
3. `advance`: jump-forward, drafts (`drafts.Drafter`), each row's place among the mask rows.
4. `fill`, then `check_outputs`: every mask row in one or two backend calls, then the schema
   output checks on them.
5. `answer`: the `StepResult`; `settle_budgets` fails the requests whose work passed the budget.

A row whose answer is decided (an error, a desync) leaves the later phases (`Row.end`). Work done
for one row alone is timed on its `Row.cpu`; the batched calls are timed as a whole, and when they
take longer than one request's budget the next step is an audit step that makes them row by row.
"""

from __future__ import annotations

import time

import numpy as np
from google.rpc import status_pb2

from grammar_service import metrics
from grammar_service.backend import RequestGrammar
from grammar_service.budget import CpuMeter, consume_within
from grammar_service.drafts import Drafter
from grammar_service.masks import MaskBuffer
from grammar_service.request import Request, row_error, unknown_request
from grammar_service.runtime import Runtime
from grammar_service.schema.monitor import Ahead
from maskwire.bitmask import encode_rows
from maskwire.v1 import grammar_pb2

OK = grammar_pb2.ROW_STATUS_OK
DESYNC = grammar_pb2.ROW_STATUS_DESYNC
ERROR = grammar_pb2.ROW_STATUS_ERROR
UNKNOWN = grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST


class Row:
    """One row of a step: its request while the row is live, what the phases decided for it, and
    the CPU time spent on it alone."""

    __slots__ = (
        "accepted",
        "accepting",
        "ahead",
        "cpu",
        "drafts",
        "error",
        "expected",
        "ff",
        "forced_drafts",
        "forced_jump",
        "req",
        "request_id",
        "room",
        "slot",
        "status",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.req: Request | None = None  # set while the row is live (its answer not decided)
        self.status = OK
        self.error: status_pb2.Status | None = None
        self.expected = 0  # DESYNC: the position the service expected
        self.cpu = CpuMeter()
        self.drafts: list[int] = []  # to check: the worker's, or drafts of forced text
        self.room = 0  # StepRow.forced_draft_room
        self.ff: list[int] = []  # jump-forward tokens consumed this step
        self.forced_drafts: list[int] = []  # drafts of forced text, in place of the worker's
        self.forced_jump: tuple[int, int] | None = None  # forced tokens among forced_drafts
        self.accepted = 0  # leading drafts accepted
        self.slot = -1  # first mask row; -1: none (unconstrained, or decided)
        self.ahead: list[Ahead] | None = None  # output check: the output after each draft
        self.accepting: bool | None = None  # what the output check says, for checked rows

    def end(self, status: grammar_pb2.RowStatus, error: status_pb2.Status | None = None) -> None:
        """Decide the row's answer now: it takes no further part in the step."""
        self.status = status
        self.error = error
        self.req = None

    def fail(self) -> None:
        """End the row with its request's error (the request is dead)."""
        assert self.req is not None
        self.end(ERROR, self.req.dead)


class StepWork:
    """The rows of one Step and the phases that answer them."""

    def __init__(
        self,
        runtime: Runtime,
        requests: dict[str, Request],
        drafter: Drafter,
        buffer: MaskBuffer,
        audit: bool,
        msg: grammar_pb2.Step,
    ) -> None:
        self.backend = runtime.backend
        self.limits = runtime.limits
        self.budget = runtime.limits.max_request_step_s
        self.requests = requests
        self.drafter = drafter
        self.tok = drafter.tok
        self.vocab = drafter.vocab
        self.max_drafts = runtime.limits.max_drafts_per_row
        self.buffer = buffer
        self.audit = audit
        self.msg = msg
        self.rows: list[Row] = []
        self.singles: list[tuple[Row, Request, int]] = []  # rows of one new token, for `consume`
        self.n_masks = 0  # mask rows of the step
        self.batched_s = 0.0  # wall time of the calls that do many rows at once

    # -- phase 1 ----------------------------------------------------------------------------
    def check(self) -> None:
        """Check every row, feed reasoning gates, consume runs of several tokens; rows of one
        token wait for `consume`."""
        # Runs once per row of every step: each protobuf field is read once, and the common
        # case (one new token, no drafts, no reasoning gate) is kept short.
        seen: set[str] = set()
        for pb in self.msg.rows:
            row = Row(pb.request_id)
            self.rows.append(row)
            new = list(pb.new_tokens)
            req = self._admit(row, pb, new, seen)
            if req is not None:
                self._feed(row, req, new)

    def _admit(
        self, row: Row, pb: grammar_pb2.StepRow, new: list[int], seen: set[str]
    ) -> Request | None:
        """The row's request when the row is in order (its position advanced), else None."""
        rid = row.request_id
        req = self.requests.get(rid)
        if req is None:
            row.end(UNKNOWN, unknown_request(rid))
            return None
        if rid in seen:
            msg = f"request {rid!r} appears more than once in step {self.msg.step}"
            row.end(ERROR, row_error(msg, "DUPLICATE_ROW"))
            return None
        seen.add(rid)
        if req.dead is not None:
            row.end(ERROR, req.dead)
            return None
        want = req.position + len(new)
        if pb.position != want:
            row.end(DESYNC)
            row.expected = want
            return None
        vocab = self.vocab
        if new and (min(new) < 0 or max(new) >= vocab):
            bad = next(t for t in new if not 0 <= t < vocab)
            req.kill(f"token {bad} is out of range [0, {vocab})", "TOKEN_OUT_OF_RANGE")
            row.end(ERROR, req.dead)
            return None
        req.position = want
        row.req = req
        drafts = pb.draft_tokens
        if drafts:
            row.drafts = list(drafts[: self.max_drafts])
        room = pb.forced_draft_room
        if room:
            row.room = min(room, self.max_drafts)
        return req

    def _feed(self, row: Row, req: Request, new: list[int]) -> None:
        if not new:
            return
        gate = req.gate
        if gate is not None and not gate.done:
            skip = gate.feed(new, self.tok.token_bytes)
            if skip == len(new):
                return
            new = new[skip:]
        elif len(new) == 1:
            self.singles.append((row, req, new[0]))
            return
        if not consume_within(req.grammar, new, self.budget, row.cpu):
            req.kill_unconsumed(row.cpu.spent, self.budget)
            row.fail()
        elif not self._watch(row, req, new):
            row.fail()

    # -- phase 2 ----------------------------------------------------------------------------
    def consume(self) -> None:
        """One new token per row in one batched call (row by row, timed, in an audit step)."""
        if not self.singles:
            return
        pairs = [(req.grammar, token) for _, req, token in self.singles]
        if self.audit:
            oks: list[bool] = []
            for (row, _, _), pair in zip(self.singles, pairs, strict=True):
                with row.cpu:
                    oks += self.backend.consume_each([pair])
        else:
            t0 = time.perf_counter()
            oks = self.backend.consume_each(pairs)
            self.batched_s += time.perf_counter() - t0
        for (row, req, token), ok in zip(self.singles, oks, strict=True):
            if not ok:
                req.kill_by_grammar()
                row.fail()
            elif req.monitor is not None and not self._watch(row, req, [token]):
                row.fail()

    # -- phase 3 ----------------------------------------------------------------------------
    def advance(self) -> None:
        """Jump-forward, drafts, and each live row's place among the step's mask rows."""
        for row in self.rows:
            req = row.req
            if req is None:
                continue
            gate = req.gate
            if gate is not None and not gate.done:
                if row.drafts:
                    row.accepted = self.drafter.unconstrained(gate, row.drafts)
                continue  # unconstrained at this position: no mask row
            if req.jump_forward and not self._jump_forward(row, req):
                continue
            if row.drafts:
                self._check_drafts(row, req)
            row.slot = self.n_masks
            self.n_masks += 1 + row.accepted

    def _jump_forward(self, row: Row, req: Request) -> bool:
        """Consume the tokens the grammar forces now. False: the row failed."""
        g = req.grammar
        with row.cpu:
            forced = g.ff_tokens()
        if not forced:
            return True
        if not self._forced_ok(row, req, forced):
            row.fail()
            return False
        if not consume_within(g, forced, self.budget, row.cpu):
            req.kill_unconsumed(row.cpu.spent, self.budget)
            row.fail()
            return False
        if not self._watch(row, req, forced):
            row.fail()
            return False
        req.position += len(forced)
        row.ff = forced
        if row.room:
            # The worker drafted without knowing `forced`: its drafts would not follow them.
            # Draft what the grammar forces beyond them instead.
            with row.cpu:
                row.drafts = row.forced_drafts = self.drafter.of_forced(g, row.room)
        return True

    def _check_drafts(self, row: Row, req: Request) -> None:
        # Drafts of forced text (after jump-forward tokens) are not extended again.
        tail_room = 0 if row.ff else row.room
        with row.cpu:
            checked = self.drafter.check(req.grammar, row.drafts, tail_room, req.jump_forward)
            if checked.jump is not None:
                row.drafts = row.forced_drafts = checked.drafts
                row.forced_jump = checked.jump
            accepted = checked.accepted
            if accepted and req.monitor is not None:  # and the output check, draft by draft
                row.ahead = req.monitor.ahead(checked.drafts[:accepted])
                accepted = len(row.ahead)
        row.accepted = accepted

    # -- phase 4 ----------------------------------------------------------------------------
    def fill(self) -> None:
        """Every mask row of the step in one or two backend calls (one per row, timed, in an
        audit step)."""
        if not self.n_masks:
            return
        self.buffer.reserve(self.n_masks)
        masked = [(row, req) for row in self.rows if (req := row.req) is not None and row.slot >= 0]
        t0 = time.perf_counter()
        if self.audit:
            for row, req in masked:
                with row.cpu:
                    self._fill([(row, req)])
        else:
            self._fill(masked)
            self.batched_s += time.perf_counter() - t0
        metrics.MASK_SECONDS_PER_ROW.observe((time.perf_counter() - t0) / self.n_masks)

    def _fill(self, masked: list[tuple[Row, Request]]) -> None:
        plain: list[tuple[RequestGrammar, int]] = []
        drafted: list[tuple[RequestGrammar, int, list[int]]] = []
        for row, req in masked:
            if row.accepted:
                drafted.append((req.grammar, row.slot, row.drafts[: row.accepted]))
            else:
                plain.append((req.grammar, row.slot))
        buf = self.buffer
        self.backend.fill(plain, drafted, buf.ptr, buf.one_mask_bytes, buf.capacity)

    # -- phase 4, the output check ------------------------------------------------------------
    def _watch(self, row: Row, req: Request, tokens: list[int]) -> bool:
        """Feed consumed tokens to the request's output check. False (the request is dead) when
        they complete a value that violates the schema: the mask did not allow them."""
        if req.monitor is None:
            return True
        with row.cpu:
            err = req.monitor.feed(tokens)
        if err is None:
            return True
        if req.monitor.cut_short:  # the mask allowed it untried (the check ran out of time)
            req.unsatisfied(f"the output violates the schema: {err}")
        else:
            req.kill(f"the token violates the schema: {err}", "TOKEN_REJECTED")
        return False

    def _forced_ok(self, row: Row, req: Request, forced: list[int]) -> bool:
        """Whether the tokens the grammar forces keep the output valid; when they cannot, no
        continuation can, and the request ends unsatisfied."""
        if req.monitor is None:
            return True
        with row.cpu:
            err = req.monitor.try_tokens(forced)
        if err is None:
            return True
        req.unsatisfied(f"the grammar forces text that violates the schema: {err}")
        return False

    def check_outputs(self) -> None:
        """Apply the output checks to the filled mask rows of checked requests. A request whose
        main row is left empty fails now; one whose row after a draft is left empty accepts
        only the drafts before it. Rows that leave the answer are removed."""
        if not self.n_masks:
            return
        masks = self.buffer.rows(self.n_masks)
        drop: set[int] = set()
        for row in self.rows:
            req = row.req
            if req is None or req.monitor is None or row.slot < 0:
                continue
            if not req.monitor.tracked and row.ahead is None and not req.grammar.is_accepting():
                continue  # validation only: nothing to do until the output can end
            self._check_output(row, req, masks, drop)
        if drop:
            self._drop_masks(masks, drop)

    def _check_output(self, row: Row, req: Request, masks: np.ndarray, drop: set[int]) -> None:
        monitor = req.monitor
        assert monitor is not None
        slot = row.slot
        with row.cpu:
            ok, masked = monitor.filter(masks[slot].view(np.uint32))
            left = bool(masks[slot].any())
            for j, view in enumerate((row.ahead or [])[: row.accepted]):
                _, more = monitor.filter(masks[slot + 1 + j].view(np.uint32), view)
                masked += more
                if not masks[slot + 1 + j].any():  # that draft leads nowhere valid
                    drop.update(range(slot + 1 + j, slot + 1 + row.accepted))
                    row.accepted = j
                    break
        metrics.SCHEMA_TOKENS_MASKED.inc(masked)
        row.accepting = ok
        if left and (ok or not req.grammar.is_stopped()):
            return
        why = monitor.document_error() if req.grammar.is_accepting() else None
        req.unsatisfied(
            f"the output is complete but does not validate: {why}"
            if why
            else "no token keeps the output valid against the schema"
        )
        drop.update(range(slot, slot + 1 + row.accepted))
        row.fail()

    def _drop_masks(self, masks: np.ndarray, drop: set[int]) -> None:
        keep = [r for r in range(self.n_masks) if r not in drop]
        masks[: len(keep)] = masks[keep]
        new_slot = {old: new for new, old in enumerate(keep)}
        for row in self.rows:
            if row.slot >= 0:
                row.slot = new_slot.get(row.slot, -1)
        self.n_masks = len(keep)

    # -- phase 5 ----------------------------------------------------------------------------
    def answer(self) -> grammar_pb2.StepResult:
        out = grammar_pb2.StepResult(step=self.msg.step)
        self._masks(out)
        add = out.rows.add
        for row in self.rows:
            req = row.req
            if req is None:
                self._decided(out, row)
            elif row.slot < 0:  # unconstrained (reasoning): no mask row
                add(
                    request_id=row.request_id,
                    status=OK,
                    accepted_drafts=row.accepted,
                    position=req.position,
                )
            else:
                self._answered(out, row, req)
        return out

    def _masks(self, out: grammar_pb2.StepResult) -> None:
        n, buf = self.n_masks, self.buffer
        if n and self.msg.compact_masks and n >= self.limits.compact_min_rows:
            c = encode_rows(buf.rows(n), self.vocab)
            out.bitmask = c.dense
            out.mask_row_encodings.extend(c.encodings.tolist())
            out.mask_row_word_counts.extend(c.counts.tolist())
            out.mask_word_index = c.index
            out.mask_word_values = c.values
            out.mask_row_repeat_of.extend(c.repeat_of.tolist())
        elif n:
            out.bitmask = buf.tobytes(n)
        out.words_per_row = buf.words_per_row
        out.vocab_size = self.vocab

    def _answered(self, out: grammar_pb2.StepResult, row: Row, req: Request) -> None:
        g = req.grammar
        r = out.rows.add(
            request_id=row.request_id,
            status=OK,
            mask_rows=1 + row.accepted,
            accepted_drafts=row.accepted,
            position=req.position,
            accepting=g.is_accepting() if row.accepting is None else row.accepting,
            finished=g.is_stopped(),
        )
        if row.ff:
            r.ff_tokens.extend(row.ff)
        if row.forced_drafts:
            r.forced_drafts.extend(row.forced_drafts[: row.accepted])
        if row.forced_jump is not None:
            at, count = row.forced_jump
            r.forced_jump_start = at
            r.forced_jump_count = max(0, min(count, row.accepted - at))

    def _decided(self, out: grammar_pb2.StepResult, row: Row) -> None:
        rid = row.request_id
        if row.status == DESYNC:
            out.rows.add(
                request_id=rid,
                status=DESYNC,
                position=self.requests[rid].position,
                expected_position=row.expected,
            )
            return
        req = self.requests.get(rid)
        out.rows.add(
            request_id=rid,
            status=row.status,
            position=req.position if req is not None else 0,
            error=row.error,
        )

    def settle_budgets(self) -> bool:
        """Fail (from their next step) the requests whose work passed the budget. Returns
        whether the next step is an audit step: batched work too slow to tell whose it was, or
        an audit that found a request over budget."""
        over = False
        for row in self.rows:
            if row.req is not None and row.cpu.spent > self.budget:
                over = True
                row.req.kill_expensive(row.cpu.spent, self.budget)
        return (not self.audit and self.batched_s > self.budget) or (self.audit and over)
