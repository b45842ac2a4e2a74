"""Speculative decoding (`--speculative ngram`) as the step loop sees it: one object that plans a
step's drafts, decides whether they are worth a verification pass, makes the verification rows
from the grammar's answers and commits the accepted run, keeping the statistics it decides by.

A speculative step, as `Engine` runs it:

    plan      each request's drafter proposes up to k tokens (its DraftBudget's k), within the
              pass's token budget; the SpeculationGate drops them all when the pass is not worth
              the tokens they are expected to add
    grammar   one Step: new tokens applied, drafts checked but not consumed -> forced tokens,
              accepted drafts, a mask row per position, and the grammar's forced drafts
    rows      answers applied; one row per request: pending + forced + kept drafts
    forward   one "verify" pass; sample every position but a forced draft's
    commit    drafts kept while they equal the draw, the draws up to the first mismatch
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from maskwire.tokenizer import Tokenizer
from neuron_worker.drafter import DraftBudget, DraftConfig, Drafter, accepted_prefix, new_drafter
from neuron_worker.engine_config import EngineConfig
from neuron_worker.grammar_client import RowOutcome
from neuron_worker.ledger import Ledger
from neuron_worker.metrics import Metrics
from neuron_worker.request import Request
from neuron_worker.speculation_gate import SpeculationGate, Verify
from neuron_worker.step_device import Sampled
from neuron_worker.step_rows import Answers, Row

__all__ = ["Drafts", "Speculator"]

Drafts = dict[Request, list[int]]
"""A step's drafts, by request (requests without drafts are absent)."""


@dataclass
class _Answered:
    """A request still running after the grammar's answer, before the pass's token budget."""

    req: Request
    prefix: list[int]  # pending + forced tokens
    drafts: list[int]  # its own kept drafts, or the grammar's forced drafts
    own: int  # leading drafts that are the row's own
    jump: tuple[int, int]  # forced tokens among the drafts (`Row.jump`)
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


class Speculator:
    """Drafts, the gate, verification rows and commit (module docstring). `overlap`: whether
    plain steps overlap the grammar's round trip with the forward pass."""

    def __init__(
        self,
        config: DraftConfig,
        *,
        tokenizer: Tokenizer,
        ledger: Ledger,
        metrics: Metrics,
        overlap: bool,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.metrics = metrics
        self.overlap = overlap
        self.gate = SpeculationGate(pause=config.pause_declines) if config.gate else None
        # Moving average of the grammar's drafts after a row's own (`rows`).
        self.forced_tail = config.forced_drafts / 2
        # This step's rows whose drafts are verified without the grammar's tail after them.
        self._tailless: set[Request] = set()
        # The tokens of this step's pass that are rows' own drafts and the tails after them.
        self._own_tokens = 0

    @classmethod
    def of(
        cls, config: EngineConfig, tokenizer: Tokenizer, ledger: Ledger, metrics: Metrics
    ) -> Speculator | None:
        """The engine's speculator (None without `--speculative`)."""
        if config.speculative is None:
            return None
        return cls(
            config.speculative,
            tokenizer=tokenizer,
            ledger=ledger,
            metrics=metrics,
            overlap=config.overlap,
        )

    # ------------------------------------------------------------------ plan
    def plan(self, batch: list[Request]) -> Drafts:
        """Each request's draft tokens (none when speculation is off for it), within the pass's
        token budget (`DraftConfig.pass_tokens`; each row's pending token counts), but a copy
        that closes a string of a constrained output (`_brings_tail`) is kept whole and not
        counted: the grammar's forced tail comes with it, and verified without a budget such
        copies paid at c8 where other drafts did not. Then the gate's decision: all of them
        (with or without the grammar's forced tails after them), or none. None at all, without
        asking the drafters, while the gate pauses drafting at this batch size
        (`SpeculationGate.drafting`)."""
        self._tailless = set()
        self._own_tokens = 0
        if self.gate is not None and not self.gate.drafting(len(batch)):
            return {}  # the gate keeps declining at this batch size: drafting buys nothing
        spec = self.config
        left = spec.pass_tokens - len(batch) if spec.pass_tokens else None
        drafts: Drafts = {}
        for r in batch:
            if not r.speculate:
                continue
            if left is not None and left <= 0 and r.grammar is None:
                # No room left in the pass, and only a constrained row's copy that closes a
                # string goes beyond it: a full batch of free text drafts nothing (its history
                # reaches the drafter when it next may draft).
                continue
            if r.drafter is None:
                r.drafter = new_drafter(spec, self.tokenizer.token_bytes, self.tokenizer.encode)
                r.budget = DraftBudget(spec)
            assert r.budget is not None
            r.budget.score_declined(r.output)
            _sync_history(r.drafter, r)
            most = min(spec.num_draft_tokens, self.ledger.room(r) - 1)
            want = min(r.budget.want(), most)
            d = self._propose(r.drafter, want, most) if want > 0 else []
            if left is not None and not self._brings_tail(r, d):
                d = d[: max(0, left)]
                left -= len(d)
            if d:
                drafts[r] = d
                self.metrics.drafts(proposed=len(d))
        return self._worth_verifying(batch, drafts)

    def _worth_verifying(self, batch: list[Request], drafts: Drafts) -> Drafts:
        """The drafts this step verifies: all of them, or none when the gate finds the wider
        pass not worth the tokens they are expected to add; where it finds the grammar's tails
        after them not worth their width, all of them without tails (`forced_room`)."""
        if self.gate is None or not drafts:
            return drafts
        rows = []
        for r, d in drafts.items():
            assert r.budget is not None  # made with its drafter
            # Drafts that close a quoted string are likely to get the grammar's forced tokens
            # after them (the next key), as many as such tails have had so far.
            tail = self.forced_tail if self._brings_tail(r, d) else 0.0
            rows.append((len(d), r.budget.acceptance(), tail))
        verify = self.gate.decide(len(batch), rows)
        if verify == Verify.DRAFTS:
            self._tailless = set(drafts)
        if verify != Verify.NONE:
            return drafts
        for r, d in drafts.items():
            assert r.budget is not None
            r.budget.declined(d, len(r.output))
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

    def applies(self, batch: list[Request], drafts: Drafts) -> bool:
        """Whether this step is a speculative one: some row has drafts, or the grammar may
        force some. The latter only without overlap: the plain step then waits for the grammar
        before its forward anyway, so the speculative one costs nothing more."""
        if drafts:
            return True
        return not self.overlap and any(r.speculate and r.grammar is not None for r in batch)

    def forced_room(self, constrained: list[Request]) -> list[int]:
        """How many forced drafts the grammar may send each constrained request (none after
        drafts the gate verifies without their tails)."""
        spec = self.config
        return [
            max(0, min(spec.forced_drafts, self.ledger.room(r) - 1))
            if r.speculate and r not in self._tailless
            else 0
            for r in constrained
        ]

    def record(self, rows: int, width: int, seconds: float) -> None:
        """The gate learns from the step's wall time and the tokens it forwarded. A step
        without drafts of its own (forced ones only) is what the gate's "no" costs: it counts
        as a plain step."""
        if self.gate is not None:
            self.gate.record(rows, width, self._own_tokens, seconds)

    # ------------------------------------------------------------------ verification rows
    def rows(self, batch: list[Request], drafts: Drafts, answers: Answers) -> list[Row]:
        """Apply the grammar's answers; each live request becomes one row of pending + forced +
        kept drafts, with logits wanted at every draft position (but a forced draft's,
        `Row.wanted`) and the one after.
        Forced tokens count against the pass's token budget before drafts do; the grammar's
        forced drafts do not count (it forces those bytes: they are nearly always accepted, and
        at c8 they were worth their width, 1.07x against 0.94x with them in the budget), nor do
        own drafts that close a string (`plan`)."""
        live: list[_Answered] = []
        for r in batch:
            pending = r.pending
            r.pending = None
            out = answers.get(r)
            ff = self.ledger.apply_answer(r, out)
            if ff is not None:
                assert pending is not None
                live.append(self._answered(r, [pending, *ff], ff, drafts.get(r, []), out))
        spec = self.config
        left = None
        if spec.pass_tokens:
            left = spec.pass_tokens - sum(len(a.prefix) for a in live)
        rows: list[Row] = []
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
            if own:
                self._own_tokens += len(d)  # with the grammar's tail after them
            r = a.req
            rows.append(Row(r, [*a.prefix, *d], r.cached, 1 + len(d), own_drafts=own, jump=jump))
            r.cached += len(a.prefix)
        return rows

    def _answered(
        self,
        r: Request,
        prefix: list[int],
        ff: list[int],
        planned: list[int],
        out: RowOutcome | None,
    ) -> _Answered:
        """A live request's drafts after the grammar's answer `out` (forced tokens `ff`): its
        own up to the first the grammar rejects, or the grammar's forced drafts."""
        d, own, jump = planned, len(planned), (0, 0)
        if out is not None and out.forced_drafts:
            # The grammar's drafts: after its forced tokens (none of the row's own), or the
            # row's own drafts and the bytes forced after them (`_own_prefix` of them).
            own = 0 if ff else _own_prefix(out.forced_drafts, planned)
            tail = len(out.forced_drafts) - own
            self.metrics.drafts(forced=tail)
            if own:
                self.forced_tail += 0.2 * (tail - self.forced_tail)
            d, jump = out.forced_drafts, out.forced_jump
        elif out is not None:
            d = d[: out.accepted_drafts]
        closing = self._brings_tail(r, planned)
        d = d[: max(0, self.ledger.room(r) - 1)]
        return _Answered(r, prefix, d, min(own, len(d)), jump, closing)

    # ------------------------------------------------------------------ commit
    def commit(self, rows: list[Row], sampled: Sampled) -> None:
        """Per row, the drafts the sampler agreed with and the token after them."""
        i = 0
        accepted_total = emitted = 0
        for row in rows:
            at = {j: i + n for n, j in enumerate(row.wanted())}  # position -> logits row
            i += len(at)
            accepted, drawn = self._commit_row(row, at, sampled)
            accepted_total += accepted
            emitted += drawn
        self.metrics.drafts(accepted=accepted_total)
        self.metrics.tokens(emitted, 0)

    def _commit_row(self, row: Row, at: dict[int, int], sampled: Sampled) -> tuple[int, int]:
        """One row's accepted run; returns (drafts accepted, tokens drawn and emitted)."""
        r = row.req
        d = row.tokens[len(row.tokens) - row.outputs + 1 :]
        start, count = row.jump
        forced = range(start, start + count)
        # No draw at a forced position: `accepted_prefix` keeps the draft there.
        drawn = [sampled.tokens[at[j]] if j in at else -1 for j in range(row.outputs)]
        a = accepted_prefix(drawn, d, forced)
        if r.budget is not None and row.own_drafts:
            r.budget.record(row.own_drafts, min(a, row.own_drafts))
        r.draft_tokens += len(d)
        r.accepted_drafts += a
        emitted = 0
        for j in range(a + 1):
            if r.finished:
                break
            if j in forced:
                if self.ledger.append(r, [d[j]], forced=True):
                    break
            else:
                lp = sampled.logprobs[at[j]] if sampled.logprobs else None
                self.ledger.accept(r, drawn[j], lp)
                emitted += 1
            if j < a and not r.finished:  # an accepted draft: its K/V is in the cache
                r.cached += 1
                r.verified.append(d[j])
                r.pending = None
        return a, emitted
