"""The speculation gate's cost model and decision (`neuron_worker.speculation_gate`)."""

from __future__ import annotations

import pytest

from neuron_worker.drafter import DraftBudget, DraftConfig
from neuron_worker.speculation_gate import PassCosts, SpeculationGate, Verify, expected_tokens


def verifies(gate: SpeculationGate, rows: int, drafts: list[tuple[int, float, float]]) -> bool:
    """Whether the gate verifies the drafts (with their tails or without)."""
    return gate.decide(rows, drafts) != Verify.NONE


def test_expected_tokens_counts_each_draft_while_all_before_it_are_accepted() -> None:
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(4, 0.0) == 1.0
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


def test_unmeasured_shapes_are_tried_first() -> None:
    gate = SpeculationGate()
    assert verifies(gate, 8, [(4, 0.1, 0)])  # no speculative pass measured yet
    gate.record(8, 12, 4, 0.012)
    assert not verifies(gate, 8, [(4, 0.9, 0)])  # no plain step measured yet
    gate.record(8, 8, 0, 0.010)
    assert verifies(gate, 8, [(3, 0.9, 0)])  # 11 tokens: one speculative width, no estimate
    gate.record(8, 11, 3, 0.0115)
    assert not verifies(gate, 8, [(4, 0.1, 0)])  # measured, and not worth it
    # 17 tokens: wider than any pass so far, estimated on the line through 11 and 12 (14.5 ms)
    assert not verifies(gate, 8, [(4, 0.1, 0), (5, 0.1, 0)])
    assert not verifies(gate, 4, [(8, 0.9, 0)])  # 12 tokens, measured; one plain width only
    assert not verifies(gate, 8, [])


def test_speculates_when_the_expected_tokens_pay_for_the_wider_step() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(8, 8, 0, 0.010)
    gate.record(8, 16, 8, 0.0137)  # a verify step 1.37x a plain one (the H200's)
    # Free text: two rows with 4 drafts each at 16% acceptance add 0.38 tokens to 8: no.
    assert not verifies(gate, 8, [(4, 0.16, 0), (4, 0.16, 0)])
    # Extraction: two rows at 80% add 4.7 tokens to 8: yes.
    assert verifies(gate, 8, [(4, 0.8, 0), (4, 0.8, 0)])


def test_every_probe_th_decision_takes_the_other_choice() -> None:
    gate = SpeculationGate(probe=4)
    gate.record(1, 1, 0, 0.010)
    gate.record(1, 5, 4, 0.100)
    decisions = [verifies(gate, 1, [(4, 0.5, 0)]) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2


def test_costs_are_medians_of_the_recent_measurements_by_width() -> None:
    costs = PassCosts(window=3)
    assert costs.get(8) is None
    costs.add(8, 0.010)
    costs.add(8, 0.020)
    assert costs.get(8) == pytest.approx(0.015)
    assert costs.get(9) is None  # one width: no line to read another off
    for seconds in (0.012, 0.013, 0.011):
        costs.add(8, seconds)  # the window keeps the last three
    assert costs.get(8) == pytest.approx(0.012)


def test_an_unmeasured_width_is_read_off_the_line_through_its_nearest_measured_ones() -> None:
    costs = PassCosts(window=5)
    costs.add(8, 0.050)
    costs.add(20, 0.110)
    costs.add(24, 0.150)
    assert costs.get(14) == pytest.approx(0.080)  # between 8 and 20
    assert costs.get(22) == pytest.approx(0.130)  # between 20 and 24: their line, not 8's
    assert costs.get(30) == pytest.approx(0.210)  # beyond: the line through 20 and 24
    assert costs.get(6) == pytest.approx(0.040)  # below: the line through 8 and 20
    steep = PassCosts(window=5)
    steep.add(8, 0.020)
    steep.add(12, 0.060)
    assert steep.get(4) == pytest.approx(0.010)  # the line's -0.020 s: half the 8-token pass
    flat = PassCosts(window=5)
    flat.add(8, 0.020)
    flat.add(16, 0.015)  # a faster wide pass (a neighbour left): the line does not fall
    assert flat.get(32) == pytest.approx(0.015)


def test_forced_tokens_count_in_the_plain_step_as_in_the_speculative_one() -> None:
    """Steps without drafts of their own forward the grammar's forced tokens too (8 rows and 12
    forced tokens: 109 ms, against 52 ms without): their cost is read at their width, and the
    forced tokens widen the plain step's pass. Measured beside a busy process on the AVX2 code
    paths, where a pass costs about its width: drafts at 50% acceptance do not pay."""
    drafts = [(3, 0.5, 0)] * 4  # 12 drafts expected to add 3.5 tokens
    for wide, verdict in [((0.105, 0.140), Verify.NONE), ((0.060, 0.070), Verify.DRAFTS)]:
        gate = SpeculationGate(probe=1000)
        gate.record(8, 17, 9, wide[0])
        gate.record(8, 23, 15, wide[1])
        gate.record(8, 8, 0, 0.052)
        gate.record(8, 20, 0, 0.109)
        assert gate.forced == pytest.approx(2.4)  # a moving average
        # 8 sampled tokens in 61 ms (a plain step of 10.4 tokens) against 11.5 in 134 ms (22.4
        # tokens: no), or in 68 ms where wide passes cost little more (yes)
        assert gate.decide(8, drafts) == verdict


def test_each_choice_learns_how_wide_its_passes_are() -> None:
    """The grammar forces tokens whatever the choice, and cuts drafts and tails: the gate
    follows both."""
    gate = SpeculationGate(probe=1000)
    tails = [(4, 0.9, 8), (4, 0.9, 8)]  # 8 drafts and 16 tokens of tails expected
    assert gate.decide(8, tails) == Verify.TAILS  # nothing measured
    gate.record(8, 20, 12, 0.015)  # the grammar sent 4 of the 16
    assert gate.extra[Verify.TAILS] == pytest.approx(0.2 * (12 - 24))
    assert gate.forced == 0
    gate.record(8, 11, 0, 0.010)  # a step no row drafted in: 3 forced tokens
    assert gate.forced == pytest.approx(0.6)
    assert gate.decide(8, [(4, 0.9, 0)]) == Verify.DRAFTS  # 13 tokens: one width measured
    gate.record(8, 13, 3, 0.012)  # the grammar kept 3 of the 4 drafts and forced 2 tokens
    assert gate.extra[Verify.DRAFTS] == pytest.approx(-0.2)
    assert gate.forced == pytest.approx(0.6 + 0.2 * (2 - 0.6))
    assert gate.extra[Verify.TAILS] == pytest.approx(-2.4)


def test_one_slow_step_does_not_turn_the_gate() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(1, 1, 0, 0.006)
    for _ in range(3):
        gate.record(1, 5, 4, 0.008)  # verification passes at 1.33x a plain step
    assert verifies(gate, 1, [(4, 0.6, 0)])  # 2.3 tokens for 1.33x the cost
    gate.record(1, 5, 4, 0.080)  # one pass that a neighbour stalled
    assert verifies(gate, 1, [(4, 0.6, 0)])
    gate.record(1, 5, 4, 0.080)
    gate.record(1, 5, 4, 0.080)  # a lasting change moves the median
    assert not verifies(gate, 1, [(4, 0.6, 0)])


def test_a_budgets_acceptance_estimate_follows_its_verifications() -> None:
    budget = DraftBudget(DraftConfig(num_draft_tokens=4))
    assert budget.acceptance() == 0.5  # the prior: one accepted, one rejected
    budget.record(4, 4)  # all accepted: no rejection
    budget.record(4, 2)  # two accepted, then a rejection; the one before weighs 0.7
    assert budget.acceptance() == pytest.approx((4.8 + 1) / (4.8 + 1 + 2))
    for _ in range(8):
        budget.record(1, 0)  # a run of misses: the estimate follows them down
    assert budget.acceptance() < 0.25


def test_the_grammars_forced_tails_are_tried_first_then_the_drafts_alone() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(8, 8, 0, 0.010)
    tails = [(4, 0.9, 8), (4, 0.9, 8)]  # 8 pending + 8 drafts + 16 forced: a 32-token pass
    assert gate.decide(8, tails) == Verify.TAILS
    gate.record(8, 32, 24, 0.020)
    assert gate.decide(8, tails) == Verify.DRAFTS  # a 16-token pass: not measured yet
    assert verifies(gate, 8, tails)


def test_a_tail_counts_the_step_it_saves_against_the_width_it_adds() -> None:
    """Two rows with 4 drafts at 90% expect 6.19 more sampled tokens; their tails, reached
    where all 4 drafts are accepted (0.66 each), save a step each: 1.31."""
    tails = [(4, 0.9, 8), (4, 0.9, 8)]
    gate = SpeculationGate(probe=1000)
    gate.record(8, 8, 0, 0.010)  # plain: 800 tokens/s
    gate.record(8, 16, 8, 0.012)  # drafts alone, 16 tokens: 14.19 / 12 ms = 1182 tokens/s
    gate.record(8, 32, 24, 0.020)  # with tails, 32 tokens: 15.5 / 20 ms = 775 tokens/s
    assert gate.decide(8, tails) == Verify.DRAFTS  # where a pass costs about its width
    gate = SpeculationGate(probe=1000)
    gate.record(8, 8, 0, 0.010)
    gate.record(8, 16, 8, 0.012)
    gate.record(8, 32, 24, 0.0125)  # 15.5 / 12.5 ms = 1240 tokens/s: wide passes cost little more
    assert gate.decide(8, tails) == Verify.TAILS
    gate = SpeculationGate(probe=1000)
    gate.record(8, 8, 0, 0.010)
    gate.record(8, 16, 8, 0.020)
    gate.record(8, 32, 24, 0.030)
    assert gate.decide(8, [(4, 0.3, 8), (4, 0.3, 8)]) == Verify.NONE  # 8.85 / 20 ms, 8.87 / 30 ms
    assert not verifies(gate, 8, [(4, 0.3, 8), (4, 0.3, 8)])


def test_the_drafts_alone_defer_the_width_of_tails_they_would_have_reached() -> None:
    """Two rows with 4 drafts that are always accepted: without their tails, the next step
    forwards those 16 forced tokens by jump-forward, so their width is paid either way, and the
    tails save a step."""
    tails = [(4, 1.0, 8), (4, 1.0, 8)]
    gate = SpeculationGate(probe=1000)
    gate.record(8, 8, 0, 0.010)
    gate.record(8, 16, 8, 0.012)  # drafts alone: 16 tokens in 12 ms, + 6 ms deferred
    gate.record(8, 32, 24, 0.018)  # with tails: 18 tokens in 18 ms
    assert gate.decide(8, tails) == Verify.TAILS
    never = [(4, 0.0, 8), (4, 0.0, 8)]  # drafts never accepted reach no tail: nothing deferred
    assert gate.decide(8, never) == Verify.NONE  # 8 tokens in 10 ms, 12 ms or 18 ms


def test_rows_dropped_before_the_forward_do_not_make_a_pass_free() -> None:
    """A step whose rows ended after the grammar's answer forwards fewer tokens than its rows;
    such steps neither count as negative forced tokens nor make a choice's width fall below its
    rows, where a cost read off the line through wider widths can be 0 (it divided by zero)."""
    g = SpeculationGate()
    g.record(2, 2, 0, 0.010)
    g.record(2, 4, 0, 0.030)  # the line through these two reaches 0 s at width 1
    g.record(2, 5, 3, 0.040)
    g.record(2, 7, 5, 0.050)
    for _ in range(20):
        g.record(2, 1, 0, 0.008)  # one of the two rows dropped: one token forwarded
    assert 0.0 <= g.forced < 0.01  # decays to none, never below
    assert g.decide(1, [(2, 0.5, 0.0)]) in set(Verify)


def declining_gate(pause: int = 4) -> SpeculationGate:
    """A gate whose measured costs make 8 rows' drafts not worth a pass, and 1 row's worth it."""
    gate = SpeculationGate(probe=1000, pause=pause)
    gate.record(8, 8, 0, 0.010)
    gate.record(8, 12, 4, 0.012)
    gate.record(1, 1, 0, 0.004)
    gate.record(1, 5, 4, 0.0045)
    return gate


def test_a_batch_size_the_gate_keeps_declining_pauses_drafting() -> None:
    gate = declining_gate()
    few = [(4, 0.2, 0)]
    for _ in range(4):
        assert gate.drafting(8)
        assert not verifies(gate, 8, few)
    assert [gate.drafting(8) for _ in range(5)] == [False] * 4 + [True]
    for _ in range(4):  # declined again: the next pause is twice as long
        assert not verifies(gate, 8, few)
    assert [gate.drafting(8) for _ in range(9)] == [False] * 8 + [True]
    assert gate.drafting(1)  # other batch sizes draft on
    assert verifies(gate, 1, few)


def test_a_decision_to_verify_ends_the_pauses() -> None:
    gate = declining_gate()
    for _ in range(4):
        verifies(gate, 8, [(4, 0.2, 0)])
    assert not gate.drafting(8)
    for _ in range(3):
        gate.drafting(8)
    assert verifies(gate, 8, [(4, 1.0, 0)])  # a copy worth its pass
    for _ in range(3):  # fewer declines than the patience: no pause
        verifies(gate, 8, [(4, 0.2, 0)])
    assert gate.drafting(8)
    verifies(gate, 8, [(4, 0.2, 0)])
    assert [gate.drafting(8) for _ in range(5)] == [False] * 4 + [True]  # the first length again


def test_pauses_are_capped_and_can_be_turned_off() -> None:
    gate = declining_gate()
    for _ in range(6):
        for _ in range(4):
            verifies(gate, 8, [(4, 0.2, 0)])
        paused = 0
        while not gate.drafting(8):
            paused += 1
    assert paused == 32
    gate = declining_gate(pause=0)
    for _ in range(20):
        verifies(gate, 8, [(4, 0.2, 0)])
        assert gate.drafting(8)


def test_declined_drafts_count_in_the_acceptance_estimate_once_the_output_shows_them() -> None:
    budget = DraftBudget(DraftConfig(num_draft_tokens=4))
    budget.declined([7, 8, 9, 10], at=3)
    budget.declined([1, 2], at=4)  # one at a time: dropped while the first waits
    budget.score_declined([0, 0, 0])  # nothing emitted at index 3 yet
    assert budget.acceptance() == 0.5
    budget.score_declined([0, 0, 0, 7, 8])  # accepted so far: not scored yet
    assert budget.acceptance() == 0.5
    budget.score_declined([0, 0, 0, 7, 8, 5])  # the third would have been rejected
    assert budget.acceptance() == pytest.approx((2 + 1) / (2 + 1 + 1 + 1))
    assert budget.k == 4 and budget.want() == 4  # a declined miss leaves the budget's size
    budget.declined([4, 5], at=6)
    budget.score_declined([0, 0, 0, 7, 8, 5, 4, 5, 6])  # both would have been accepted
    assert budget.acceptance() == pytest.approx((0.7 * 2 + 2 + 1) / (0.7 * 2 + 2 + 0.7 + 2))
    for _ in range(6):  # misses only lower the estimate: no pause
        budget.declined([1], at=0)
        budget.score_declined([2])
    assert budget.acceptance() < 0.3
    assert budget.want() == 4
