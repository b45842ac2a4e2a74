"""Speculative decoding: the n-gram drafter, the draft budget, the acceptance rule, and the step
loop with drafts (same outputs as without them, fewer forward passes, grammar-rejected drafts
never on the device)."""

from __future__ import annotations

import asyncio
import math
import time
import types
from collections.abc import Sequence
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch

from maskwire.v1 import common_pb2, worker_pb2
from neuron_worker import engine as engine_module
from neuron_worker.detokenize import Detokenizer
from neuron_worker.drafter import (
    DraftBudget,
    DraftConfig,
    NgramDrafter,
    TextDrafter,
    accepted_prefix,
)
from neuron_worker.engine import Engine
from neuron_worker.graphs import Pass
from neuron_worker.request import Request, Sampling
from neuron_worker.sampler import sample_tokens
from neuron_worker.speculation_gate import Verify
from neuron_worker.step_device import Sampled
from neuron_worker.step_rows import ForwardBatch, Row
from tests.unit.worker.test_engine import (
    FF,
    FORCED_DRAFT,
    NORMAL,
    REJECTED,
    TOK,
    before_each_pass,
    collect,
    make_engine,
    next_token,
)

# The fake model's text cycles through these (so prompt lookup finds repeats), with an irregular
# token whenever the sequence's sum is a multiple of 5 (so some drafts are wrong, and every
# token of the sequence matters: a K/V entry at a wrong position changes the output).
CYCLE = [NORMAL[10], NORMAL[11], REJECTED, NORMAL[12], NORMAL[13], NORMAL[14]]


def periodic(seq: Sequence[int]) -> int:
    if sum(seq) % 5 == 0:
        return next_token(seq)
    last = seq[-1]
    k = CYCLE.index(last) if last in CYCLE else -1
    return CYCLE[(k + 1) % len(CYCLE)]


def token_drafts(k: int, pass_tokens: int = 0, gate: bool = False) -> DraftConfig:
    """Token n-gram drafts: the fake model's token sequences are not how the tokenizer would
    spell their text, so the text drafter (rightly) finds nothing to propose in them. The
    speculation gate is off unless asked for: its decisions follow measured wall times, and these
    tests count what verification does with every draft."""
    return DraftConfig(
        num_draft_tokens=k,
        match="tokens",
        min_n=1,
        max_n=4,
        pass_tokens=pass_tokens,
        gate=gate,
    )


# -- drafter -------------------------------------------------------------------------------------


def test_drafter_proposes_what_followed_the_longest_earlier_suffix() -> None:
    d = NgramDrafter(1, 3)
    d.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    # Suffix [1, 2, 3] occurred at the start (followed by 4, 5); [2, 3] later (followed by 7):
    # the longest suffix wins.
    assert d.propose(2) == [4, 5]
    d.extend([7])
    # [3, 7] occurred once, followed by 1, 2, 3, 7.
    assert d.propose(10) == [1, 2, 3, 7]
    assert d.propose(0) == []


def test_drafter_finds_nothing_without_repeats() -> None:
    d = NgramDrafter(2, 4)
    d.extend(list(range(50)))
    assert d.propose(4) == []
    d.extend([10])  # a unigram repeat is below min_n
    assert d.propose(4) == []
    d.extend([11])  # [10, 11] occurred before, followed by 12...
    assert d.propose(3) == [12, 13, 14]


def text_drafter(text: str) -> TextDrafter:
    d = TextDrafter(TOK.token_bytes, TOK.encode, min_n=2, max_n=64)
    d.extend(TOK.encode(text))
    return d


def spelled(tokens: list[int]) -> list[str]:
    return [TOK.token_bytes(t).decode() for t in tokens]


def test_text_drafter_finds_a_copy_that_token_ngrams_miss() -> None:
    """A passage's ` Riverside Public Library` is one token per word; a JSON value spells its
    first word `R` `ivers` `ide`. After `"R` the text drafter proposes the rest, tokenized the
    way the value continues; the token n-gram drafter has nothing to match."""
    history = 'She works at the Riverside Public Library. {"workplace": "R'
    d = text_drafter(history)
    want = TOK.encode('"Riverside Public Library.')[2:6]
    assert spelled(want) == ["ivers", "ide", " Public", " Library"]
    assert d.propose(4) == want
    n = NgramDrafter(1, 4)
    n.extend(TOK.encode(history))
    assert n.propose(4) == []


def test_text_drafter_prefers_the_longest_earlier_suffix() -> None:
    # `at the` occurred twice; the longest suffix ` at the` followed by ` Mill` in its latest
    # occurrence wins over the word rule.
    d = text_drafter("lunch at the Old Mill, then tea at the Mill Tower. Later, dinner at the")
    assert spelled(d.propose(2)) == [" Mill", " Tower"]
    assert d.propose(0) == []


def test_text_drafter_proposes_nothing_without_a_repeat_or_a_clean_split() -> None:
    assert text_drafter("The quick brown fox jumps").propose(4) == []
    # ` Riverside` occurred, but `Riverside` tokenizes as `R` `ivers` `ide`: no run of its
    # tokens spells the partial word `Riv` the text ends with, so no draft could continue it.
    assert text_drafter("the Riverside Library. Then Riv").propose(4) == []


def quoted(prompt: str, output: str) -> TextDrafter:
    """A text drafter that saw `prompt` as the prompt and `output` as generated text."""
    d = TextDrafter(TOK.token_bytes, TOK.encode, min_n=2, max_n=64)
    d.extend(TOK.encode(prompt), output=False)
    d.extend(TOK.encode(output))
    return d


PASSAGE = (
    'Passage: "Maria Gonzalez is an architect from Valencia. Since 1990, Maria has worked at '
    "the Museum of Modern Glass, where colleagues praise the architect's patience."
)


def test_in_a_quoted_value_the_copy_ends_with_the_phrase_and_closes_the_quote() -> None:
    """Inside a string the output opened, a copy stops where the copied phrase does and closes
    the string, so the grammar can add the next key; the quote in the prompt opens nothing."""

    def draft(output: str) -> str:
        return "".join(spelled(quoted(PASSAGE, output).propose(8)))

    # A name ends before the lowercase word after it, and the passage's first mention (the full
    # name) is copied rather than its latest (`Maria has`).
    assert draft('{"name": "Maria') == ' Gonzalez"'
    # A short lowercase word between capitalized ones belongs to the name; punctuation ends it.
    assert draft('{"name": "Maria", "place": "Museum') == ' of Modern Glass"'
    # A value may capitalize the first letter of the word it copies.
    assert draft('{"name": "Maria", "job": "Arch') == 'itect"'
    # An escaped quote does not close the string.
    assert draft('{"name": "\\"Maria') == ' Gonzalez"'
    # Outside a string the copy runs on from the latest match, as before.
    assert (
        draft('{"name": "Maria", "note": 1} Maria') == " has worked at the Museum of Modern Glass"
    )


class FixedDrafter:
    """Proposes `tokens`, `k` of them."""

    def __init__(self, text: str) -> None:
        self.tokens = TOK.encode(text)

    def propose(self, k: int) -> list[int]:
        return self.tokens[:k]


def test_a_copy_that_closes_a_string_is_proposed_whole_within_the_most() -> None:
    """The budget's k cuts ordinary drafts, not a copy that closes a quoted string (cut before
    its quote it would get no forced tail); `most` (the pass budget, the room) still does."""
    engine, _ = make_engine(overlap=False, limit=30, speculative=token_drafts(4))
    speculator = engine.speculator
    assert speculator is not None
    closing = FixedDrafter(' Gonzalez"')
    assert len(closing.tokens) == 3
    assert speculator._propose(closing, 1, 4) == closing.tokens  # type: ignore[arg-type]
    assert speculator._propose(closing, 1, 2) == closing.tokens[:1]  # type: ignore[arg-type]
    running = FixedDrafter(" Gonzalez is an architect")
    assert speculator._propose(running, 1, 4) == running.tokens[:1]  # type: ignore[arg-type]


def test_budget_backs_off_pauses_and_recovers() -> None:
    cfg = DraftConfig(num_draft_tokens=4, patience=2, cooldown=3)
    b = DraftBudget(cfg)
    assert b.want() == 4
    b.record(4, 0)
    assert b.want() == 2
    b.record(2, 0)  # second miss in a row: pause
    assert [b.want() for _ in range(4)] == [0, 0, 0, 1]
    b.record(1, 1)  # a full acceptance grows the budget again
    assert b.want() == 2
    b.record(2, 1)
    assert b.want() == 2
    b.record(0, 0)  # nothing proposed: no change
    assert b.want() == 2
    b.record(2, 0)
    b.record(1, 0)  # the second pause is twice as long
    assert [b.want() for _ in range(7)] == [0] * 6 + [1]


def test_accepted_prefix() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6]) == 2
    assert accepted_prefix([5, 9, 7], [5, 6]) == 1
    assert accepted_prefix([4], []) == 0
    assert accepted_prefix([1, 2], [3, 2]) == 0
    # Drafts the grammar forces (indices 1 and 2) are kept whatever was drawn there.
    assert accepted_prefix([5, 0, 0, 6, 7], [5, 8, 9, 6], range(1, 3)) == 4
    assert accepted_prefix([5, 0, 0, 1, 7], [5, 8, 9, 6], range(1, 3)) == 3
    assert accepted_prefix([4, 0, 0, 6, 7], [5, 8, 9, 6], range(1, 3)) == 0


def test_speculative_sampling_keeps_the_distribution() -> None:
    """Toy vocabulary of 6, two positions, a fixed draft: the emitted pair (first token, second
    token) follows p(t0) p(t1 | t0) (chi-square), whether the draft is right or not."""
    v = 6
    torch.manual_seed(0)
    first = torch.randn(v)
    cond = torch.randn(v, v)  # logits of the second token given the first
    draft = int(first.argmax())  # a likely draft, so both outcomes are frequent
    n = 6000
    seeds = torch.arange(n, dtype=torch.int64)

    def draw(logits: torch.Tensor, offset: int) -> torch.Tensor:
        ones = torch.ones(n)
        return sample_tokens(
            logits,
            None,
            ones,
            ones,
            torch.zeros(n, dtype=torch.int64),
            seeds,
            torch.full((n,), offset, dtype=torch.int64),
            vocab_size=v,
            mode="sample",
        )

    # Verification pass: positions 0 (after the prompt) and 1 (after the draft).
    t0 = draw(first.expand(n, v), 0)
    at_draft = draw(cond[draft].expand(n, v), 1)
    # Rows whose draft was rejected sample their second token in the next step.
    t1_next = draw(cond[t0], 1)
    kept = torch.tensor([accepted_prefix([int(a)], [draft]) for a in t0]) == 1
    t1 = torch.where(kept, at_draft, t1_next)

    counts = torch.zeros(v, v)
    counts.index_put_((t0, t1), torch.ones(n), accumulate=True)
    expected = first.softmax(0).unsqueeze(1) * cond.softmax(1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = v * v - 1
    # p = 0.001 critical value of chi-square with 35 degrees of freedom is about 66.6.
    assert chi2 < 66.6, chi2
    assert 0.05 < float(kept.float().mean()) < 0.95
    assert math.isclose(float(kept.float().mean()), float(first.softmax(0)[draft]), abs_tol=0.03), (
        dof
    )


# -- the step loop ---------------------------------------------------------------------------------


def make_request(
    i: int,
    *,
    constrained: bool,
    max_tokens: int,
    temperature: float = 0.0,
    stop: tuple[str, ...] = (),
) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt=[CYCLE[(i + k) % len(CYCLE)] for k in range(4 + i % 5)] + [NORMAL[40 + i]],
        sampling=Sampling(max_tokens=max_tokens, temperature=temperature, seed=1000 + i, stop=stop),
        detok=Detokenizer(TOK.token_bytes, stop),
        constraint=common_pb2.Constraint(regex="x") if constrained else None,
    )


async def run(
    engine: Engine, reqs: list[Request]
) -> list[tuple[list[int], str, worker_pb2.GenerateResponse]]:
    await engine.start()
    try:
        tasks = []
        for i, r in enumerate(reqs):
            await engine.submit(r)
            tasks.append(asyncio.create_task(collect(r)))
            if i == 2:
                await asyncio.sleep(0.05)  # later requests join a running batch
        return list(await asyncio.gather(*tasks))
    finally:
        await engine.stop()


def workload(temperature: float) -> list[Request]:
    reqs = [
        make_request(
            i, constrained=i % 2 == 0, max_tokens=(17, 40, 29, 3)[i % 4], temperature=temperature
        )
        for i in range(7)
    ]
    # A stop string inside the repeating text: the accepted run crosses it.
    cycle_text = TOK.decode_bytes([CYCLE[3], CYCLE[4]]).decode()
    reqs.append(make_request(7, constrained=False, max_tokens=40, stop=(cycle_text,)))
    return reqs


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("bucketed", [True, False], ids=["buckets", "dynamic"])
async def test_speculation_changes_no_output_and_saves_passes(
    bucketed: bool, temperature: float
) -> None:
    plain, plain_model = make_engine(overlap=True, bucketed=bucketed, limit=30)
    plain_model.rule = periodic
    want = await run(plain, workload(temperature))

    spec, spec_model = make_engine(
        overlap=True, bucketed=bucketed, limit=30, speculative=token_drafts(4)
    )
    spec_model.rule = periodic
    verified_drafts: list[list[int]] = []

    async def spy(batch: ForwardBatch) -> None:
        rows, kind = batch.rows, batch.kind
        if kind == "verify":
            for row in rows:
                if row.req.constrained:
                    verified_drafts.append(row.tokens[len(row.tokens) - row.outputs + 1 :])

    before_each_pass(spec, spy)
    got = await run(spec, workload(temperature))

    for (ids, text, final), (ids0, text0, final0) in zip(got, want, strict=True):
        assert ids == ids0 and text == text0
        assert final.finish_reason == final0.finish_reason
        assert final.stop_string == final0.stop_string
        assert final.usage.completion_tokens == final0.usage.completion_tokens
        assert final.usage.forward_passes <= final0.usage.forward_passes
        assert final.usage.accepted_draft_tokens <= final.usage.draft_tokens
    stats = spec.metrics.stats
    assert stats.draft_accepted > 0 and stats.draft_kept <= stats.draft_proposed
    assert sum(f.usage.forward_passes for *_, f in got) < sum(
        f.usage.forward_passes for *_, f in want
    )
    # The grammar cut every draft at REJECTED: none reached a forward pass.
    assert verified_drafts and all(REJECTED not in d for d in verified_drafts)
    assert any(final.finish_reason == worker_pb2.FINISH_REASON_STOP_STRING for *_, final in got)
    assert not spec.requests and not spec.scheduler.running


async def gated_run(verify_s: float, decode_s: float) -> tuple[Engine, list[Any], list[Any]]:
    """The workload on a plain engine and on a gated speculative one whose verification passes
    take `verify_s` and decode passes `decode_s` (a stand-in for the device's costs) on the
    clock the engine times its steps with; the fake model's own time hardly counts on it, so
    a busy host does not move the gate's decisions."""
    plain, plain_model = make_engine(overlap=True, limit=30)
    plain_model.rule = periodic
    want = await run(plain, workload(0.0))
    spec, spec_model = make_engine(overlap=True, limit=30, speculative=token_drafts(4, gate=True))
    spec_model.rule = periodic
    passed = 0.0

    def clock() -> float:
        return time.perf_counter() / 1000 + passed

    async def costed(batch: ForwardBatch) -> None:
        nonlocal passed
        passed += verify_s if batch.kind == "verify" else decode_s

    before_each_pass(spec, costed)
    timing = types.SimpleNamespace(perf_counter=clock, monotonic=time.monotonic)
    with mock.patch.object(engine_module, "time", timing):
        got = await run(spec, workload(0.0))
    for (ids, text, _), (ids0, text0, _) in zip(got, want, strict=True):
        assert ids == ids0 and text == text0
    return spec, got, want


async def test_the_gate_declines_drafts_whose_pass_costs_more_than_they_gain() -> None:
    """Verification passes 40x a decode pass: after trying each shape, the gate declines the
    drafts (the output is the same), so few verification passes run."""
    spec, _, _ = await gated_run(verify_s=0.04, decode_s=0.001)
    stats = spec.metrics.stats
    assert stats.draft_declined > stats.draft_kept > 0
    assert stats.draft_declined + stats.draft_kept <= stats.draft_proposed
    gate = spec.speculator.gate if spec.speculator is not None else None
    assert gate is not None and gate.plain and gate.speculative


async def test_the_gate_verifies_drafts_that_pay_for_their_pass() -> None:
    """Passes that cost the same whatever their width (a launch-bound device): the gate verifies
    nearly every draft and the run takes fewer passes than without speculation."""
    spec, got, want = await gated_run(verify_s=0.01, decode_s=0.01)
    stats = spec.metrics.stats
    assert stats.draft_accepted > 0 and stats.draft_declined < stats.draft_proposed / 4
    assert sum(f.usage.forward_passes for *_, f in got) < sum(
        f.usage.forward_passes for *_, f in want
    )


async def test_drafts_stay_within_the_pass_token_budget() -> None:
    """`pass_tokens`: every row's pending and forced tokens count first; the drafter's drafts
    fill what is left of the budget and no more (the grammar's forced drafts do not count).
    The output is still the plain engine's."""
    plain, plain_model = make_engine(overlap=False, limit=30)
    plain_model.rule = periodic
    want = await run(plain, workload(0.0))

    budget = 6
    spec, spec_model = make_engine(
        overlap=False,
        limit=30,
        speculative=token_drafts(4, pass_tokens=budget),
    )
    spec_model.rule = periodic
    passes: list[tuple[int, int]] = []  # (pending + forced tokens, draft tokens) per verify pass

    async def spy(batch: ForwardBatch) -> None:
        rows, kind = batch.rows, batch.kind
        if kind == "verify":
            drafts = sum(row.outputs - 1 for row in rows)
            own = sum(row.own_drafts for row in rows)
            passes.append((sum(len(row.tokens) for row in rows) - drafts, own))

    before_each_pass(spec, spy)
    got = await run(spec, workload(0.0))

    assert [g[0] for g in got] == [w[0] for w in want]
    assert passes and all(d <= max(0, budget - fixed) for fixed, d in passes), passes
    assert any(d == budget - fixed for fixed, d in passes)  # the budget is used, not just obeyed
    assert spec.metrics.stats.draft_accepted > 0


async def test_forced_drafts_are_verified_like_drafts() -> None:
    """Without overlap every step asks the grammar for forced drafts: a row that gets FF also
    gets the grammar's FORCED_DRAFT in the same pass, and the model (which never writes it)
    rejects it: the output is the plain engine's. The drafter's budget never hears of forced
    drafts; a request that opted out gets none. (Accepted forced drafts: the end-to-end tests,
    where a real grammar forces what follows them.)"""
    plain, plain_model = make_engine(overlap=False, limit=30)
    plain_model.rule = periodic
    want = await run(plain, workload(0.0))

    spec, spec_model = make_engine(overlap=False, limit=30, speculative=token_drafts(4))
    spec_model.rule = periodic
    rows: list[tuple[bool, list[int], int]] = []

    async def spy(batch: ForwardBatch) -> None:
        pass_rows, kind = batch.rows, batch.kind
        if kind == "verify":
            rows.extend(
                (r.outputs > 1 and not r.own_drafts, r.tokens, r.outputs) for r in pass_rows
            )

    before_each_pass(spec, spy)
    reqs = workload(0.0)
    reqs[2].speculate = False
    got = await run(spec, reqs)

    assert [g[0] for g in got] == [w[0] for w in want]
    forced = [(tokens, outputs) for by_grammar, tokens, outputs in rows if by_grammar]
    assert forced and all(t[-len(FF) - 1 : -1] == FF and t[-1] == FORCED_DRAFT for t, _ in forced)
    stats = spec.metrics.stats
    assert stats.draft_forced >= len(forced)
    assert got[2][2].usage.draft_tokens == 0
    # The drafter's budget records its own drafts only.
    own = sum(r.budget.proposed for r in reqs if r.budget is not None)
    assert own == stats.draft_kept - stats.draft_forced


class Scripted:
    """A drafter that proposes the same tokens at every step."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return 1 << 30  # it has seen everything

    def extend(self, tokens: Sequence[int], output: bool = True) -> None:
        pass

    def propose(self, most: int) -> list[int]:
        return self.tokens[:most]


def test_a_copy_that_closes_a_string_is_not_cut_by_the_pass_budget() -> None:
    """Four rows and a 6-token budget leave 2 draft tokens: the first row's plain copy takes
    them; a constrained row's copy that closes a string (the grammar's forced tail may follow)
    is kept whole and not counted, in stage 1 and stage 3; the same copy in an unconstrained
    output is cut like any other."""
    engine, _ = make_engine(overlap=False, limit=30, speculative=token_drafts(4, pass_tokens=6))
    spec = engine.config.speculative
    assert spec is not None
    closing = next(t for t in range(TOK.vocab_size) if TOK.token_bytes(t) == b'"')
    plain, closes = [NORMAL[4], NORMAL[2], NORMAL[3]], [NORMAL[4], NORMAL[2], closing]
    reqs = [make_request(i, constrained=i < 3, max_tokens=30) for i in range(4)]
    for r, d in zip(reqs, [plain, closes, plain, closes], strict=True):
        r.drafter = Scripted(d)  # type: ignore[assignment]
        r.budget = DraftBudget(spec)
        r.pending = NORMAL[1]
        if r.constrained:
            r.grammar = object()  # type: ignore[assignment]

    assert engine.speculator is not None
    drafts = engine.speculator.plan(reqs)
    assert drafts == {reqs[0]: plain[:2], reqs[1]: closes}

    rows = engine.speculator.rows(reqs, {reqs[0]: plain, reqs[1]: closes}, {})
    assert [row.tokens[1:] for row in rows] == [plain[:2], closes, [], []]


@pytest.mark.parametrize("verify", [Verify.TAILS, Verify.DRAFTS, Verify.NONE])
def test_the_gate_can_verify_a_closing_copy_without_the_grammars_tail(verify: Verify) -> None:
    """Two constrained rows, one with a copy that closes a string: where the gate verifies
    drafts without their tails, the grammar gets no room for forced drafts after that row's
    copy, and the row without drafts keeps its room (forced drafts after its forced tokens);
    with tails, both have room; declined, the copy is not verified and both have room."""
    engine, _ = make_engine(overlap=False, limit=30, speculative=token_drafts(4, gate=True))
    spec = engine.config.speculative
    assert spec is not None and engine.speculator is not None
    gate = engine.speculator.gate
    assert gate is not None
    gate.decide = lambda rows, drafts: verify  # type: ignore[method-assign]
    closing = next(t for t in range(TOK.vocab_size) if TOK.token_bytes(t) == b'"')
    closes = [NORMAL[4], closing]
    reqs = [make_request(i, constrained=True, max_tokens=30) for i in range(2)]
    for r, d in zip(reqs, [Scripted(closes), Scripted([])], strict=True):
        r.drafter = d  # type: ignore[assignment]
        r.budget = DraftBudget(spec)
        r.pending = NORMAL[1]
        r.grammar = object()  # type: ignore[assignment]

    drafts = engine.speculator.plan(reqs)
    assert drafts == ({} if verify == Verify.NONE else {reqs[0]: closes})
    room = spec.forced_drafts
    want = [0, room] if verify == Verify.DRAFTS else [room, room]
    assert engine.speculator.forced_room(reqs) == want


class Counted(Scripted):
    """A scripted drafter that counts the proposals asked of it."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.asked = 0

    def propose(self, most: int) -> list[int]:
        self.asked += 1
        return super().propose(most)


@pytest.mark.parametrize(("budget", "asked"), [(3, [1, 0, 0]), (4, [1, 1, 0])])
def test_a_pass_the_batch_fills_asks_no_free_text_drafter(budget: int, asked: list[int]) -> None:
    """Three rows: when they fill the pass's budget, only a constrained row's copy that closes
    a string can still be verified, so the free-text rows' drafters are not asked (a full batch
    of free text pays nothing for speculation); with one token of room the first is."""
    engine, _ = make_engine(
        overlap=False, limit=30, speculative=token_drafts(4, pass_tokens=budget)
    )
    spec = engine.config.speculative
    assert spec is not None and engine.speculator is not None
    closing = next(t for t in range(TOK.vocab_size) if TOK.token_bytes(t) == b'"')
    closes = [NORMAL[4], closing]
    reqs = [make_request(i, constrained=i == 0, max_tokens=30) for i in range(3)]
    drafters = [Counted(closes) for _ in reqs]
    for r, d in zip(reqs, drafters, strict=True):
        r.drafter = d  # type: ignore[assignment]
        r.budget = DraftBudget(spec)
        r.pending = NORMAL[1]
    reqs[0].grammar = object()  # type: ignore[assignment]

    drafts = engine.speculator.plan(reqs)
    assert [d.asked for d in drafters] == asked
    assert drafts[reqs[0]] == closes  # kept whole: the grammar's forced tail may follow it
    assert reqs[2] not in drafts


def test_declined_drafts_are_scored_and_a_batch_size_the_gate_keeps_declining_drafts_nothing() -> (
    None
):
    """Three rows whose drafts the gate declines: each row's declined drafts count in its
    acceptance estimate once its output shows them (the first row's output went on as its
    drafts did, the second's not: both would have been accepted, and the first rejected); a row
    whose output does not show them yet keeps them for later; after the gate's
    patience of declines at that batch size, the drafters are not asked for a while."""
    engine, _ = make_engine(overlap=False, limit=30, speculative=token_drafts(4, gate=True))
    assert engine.speculator is not None
    gate = engine.speculator.gate
    assert gate is not None
    gate.record(3, 3, 0, 0.010)
    gate.record(3, 9, 6, 0.040)  # drafts at 75% acceptance or less do not pay for such a pass
    reqs = [make_request(i, constrained=False, max_tokens=30) for i in range(3)]
    draft = [NORMAL[4], NORMAL[2]]
    drafters = [Counted(draft) for _ in reqs]
    for r, d in zip(reqs, drafters, strict=True):
        r.drafter = d  # type: ignore[assignment]
        r.budget = DraftBudget(engine.config.speculative)  # type: ignore[arg-type]
        r.pending = NORMAL[1]
        r.output = [NORMAL[1]]

    assert engine.speculator.plan(reqs) == {}
    reqs[0].output += draft
    reqs[1].output += [NORMAL[3]]
    reqs[2].output += [NORMAL[4]]  # the first draft so far
    assert engine.speculator.plan(reqs) == {}
    budgets = [r.budget for r in reqs]
    assert None not in budgets
    assert [b.acceptance() for b in budgets] == pytest.approx([3 / 4, 1 / 3, 1 / 2])  # type: ignore[union-attr]
    for _ in range(2):
        assert engine.speculator.plan(reqs) == {}
    assert [d.asked for d in drafters] == [4, 4, 4]
    for _ in range(4):  # four declines in a row: four steps without drafting
        assert engine.speculator.plan(reqs) == {}
    assert [d.asked for d in drafters] == [4, 4, 4]
    engine.speculator.plan(reqs)
    assert [d.asked for d in drafters] == [5, 5, 5]

    never = replace(token_drafts(4, gate=True), pause_declines=0)
    engine, _ = make_engine(overlap=False, limit=30, speculative=never)
    assert engine.speculator is not None and engine.speculator.gate is not None
    assert engine.speculator.gate.pause == 0


async def test_forced_draft_positions_get_no_logits_and_keep_their_drafts() -> None:
    """A verification row of two own drafts, three tokens the grammar forces (`jump`) and one
    draft after them: the pass asks logits for the own drafts, the tail's draft and the position
    after it only; commit keeps the forced tokens without a draw there and emits the draws
    elsewhere, so a draw's sampling counter skips the forced positions."""
    engine, _ = make_engine(overlap=False, bucketed=False, limit=30, speculative=token_drafts(4))
    await engine.start()
    r = make_request(0, constrained=False, max_tokens=30)
    r.slot = 0
    own, jump, tail = [NORMAL[1], NORMAL[2]], [NORMAL[3], NORMAL[4], NORMAL[5]], [NORMAL[6]]
    row = Row(r, [NORMAL[0], *own, *jump, *tail], len(r.prompt), 7, own_drafts=2, jump=(2, 3))
    passes: list[Pass] = []
    forward = engine.device.forward

    def spy(p: Pass) -> Any:
        passes.append(p)
        return forward(p)

    engine.device.forward = spy  # type: ignore[method-assign]
    try:
        logits = await engine.stage.forward(ForwardBatch([row], "verify"))
    finally:
        await engine.stop()
    (p,) = passes
    assert p.last.tolist() == [0, 1, 5, 6] and logits.rows == 4  # (pending, own, own, tail)
    assert row.positions() == [(r, 0, 0), (r, 1, 1), (r, 5, 2), (r, 6, 3)]

    # The sampler agrees with the own drafts and the tail's draft, and draws NORMAL[9] after it.
    assert engine.speculator is not None
    engine.speculator.commit(
        [row], Sampled(tokens=[NORMAL[1], NORMAL[2], NORMAL[6], NORMAL[9]], logprobs=[])
    )
    assert r.output == [*own, *jump, *tail, NORMAL[9]]
    assert r.accepted_drafts == 6 and r.draft_tokens == 6

    # A draw that rejects the tail's draft replaces it; the forced tokens before it stay.
    r2 = make_request(1, constrained=False, max_tokens=30)
    r2.slot = 1
    row2 = Row(r2, [NORMAL[0], *own, *jump, *tail], len(r2.prompt), 7, own_drafts=2, jump=(2, 3))
    engine.speculator.commit(
        [row2], Sampled(tokens=[NORMAL[1], NORMAL[2], NORMAL[8], NORMAL[9]], logprobs=[])
    )
    assert r2.output == [*own, *jump, NORMAL[8]]


async def test_a_request_can_opt_out() -> None:
    spec, model = make_engine(overlap=True, limit=30, speculative=token_drafts(4))
    model.rule = periodic
    r = make_request(1, constrained=False, max_tokens=30)
    r.speculate = False
    [(ids, _, final)] = await run(spec, [r])
    assert len(ids) == 30 and final.usage.draft_tokens == 0
    assert spec.metrics.stats.draft_proposed == 0


EOS = TOK.eos_token_ids[0]
EOS_CYCLE = [*CYCLE[:3], EOS]


def ends_with_eos(seq: Sequence[int]) -> int:
    """Like `periodic`, on a cycle that passes through EOS."""
    if sum(seq) % 5 == 0:
        return next_token(seq)
    last = seq[-1]
    k = EOS_CYCLE.index(last) if last in EOS_CYCLE else -1
    return EOS_CYCLE[(k + 1) % len(EOS_CYCLE)]


@pytest.mark.parametrize("bucketed", [True, False], ids=["buckets", "dynamic"])
async def test_a_draft_that_crosses_eos_ends_the_request_there(bucketed: bool) -> None:
    """Prompts hold the cycle with its EOS, so drafts run through EOS: the request stops at the
    EOS the model draws, exactly as without speculation, and the drafts after it are dropped."""

    def workload() -> list[Request]:
        reqs = []
        for i in range(4):
            r = make_request(i, constrained=False, max_tokens=40)
            r.prompt = [*EOS_CYCLE[i % 4 :], *EOS_CYCLE, NORMAL[60 + i], EOS_CYCLE[0]]
            reqs.append(r)
        return reqs

    plain, plain_model = make_engine(overlap=True, bucketed=bucketed)
    plain_model.rule = ends_with_eos
    want = await run(plain, workload())
    spec, spec_model = make_engine(overlap=True, bucketed=bucketed, speculative=token_drafts(4))
    spec_model.rule = ends_with_eos
    crossing: list[list[int]] = []

    async def spy(batch: ForwardBatch) -> None:
        rows, kind = batch.rows, batch.kind
        if kind == "verify":
            crossing.extend(
                d for row in rows if EOS in (d := row.tokens[len(row.tokens) - row.outputs + 1 :])
            )

    before_each_pass(spec, spy)
    got = await run(spec, workload())
    assert crossing, "no draft ran through EOS"
    for (ids, text, final), (ids0, text0, final0) in zip(got, want, strict=True):
        assert (ids, text, final.finish_reason) == (ids0, text0, final0.finish_reason)
        assert EOS not in ids  # EOS ends the request; it is not part of the output
    assert any(f.finish_reason == worker_pb2.FINISH_REASON_STOP for *_, f in got)


@pytest.mark.parametrize(
    "sampling",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"logit_bias": {NORMAL[50]: 1.0}},
        {"logprobs": True},
    ],
    ids=["presence", "frequency", "repetition", "logit_bias", "logprobs"],
)
async def test_penalty_and_logprob_requests_are_not_speculated(sampling: dict[str, Any]) -> None:
    """Penalties and logprobs are computed per sampled position from the tokens before it, which
    a draft position does not have: the servicer turns speculation off for such requests. The
    same prompt without them is speculated on the same engine."""
    from neuron_worker.config import PromptLimits
    from neuron_worker.servicer import WorkerServicer

    engine, model = make_engine(overlap=True, limit=30, speculative=token_drafts(4))
    model.rule = periodic
    servicer = WorkerServicer(
        engine,
        TOK,
        model_name="fake",
        device="cpu",
        limits=PromptLimits(max_prompt_tokens=200, max_prompt_bytes=1 << 16, tokenizer_threads=1),
    )
    prompt = worker_pb2.TokenIds(ids=make_request(1, constrained=False, max_tokens=1).prompt)
    try:
        reqs = [
            await servicer._build(
                worker_pb2.GenerateRequest(
                    token_ids=prompt,
                    sampling=worker_pb2.SamplingParams(max_tokens=30, **extra),
                )
            )
            for extra in ({}, sampling)
        ]
        (_, _, plain), (_, _, asked) = await run(engine, reqs)
    finally:
        servicer.close()
    assert plain.usage.draft_tokens > 0
    assert asked.usage.completion_tokens == 30 and asked.usage.draft_tokens == 0
