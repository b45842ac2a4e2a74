"""The speculation gate's cost model and decision (`neuron_worker.speculation_gate`)."""

from __future__ import annotations

import pytest

from neuron_worker.drafter import DraftBudget, DraftConfig
from neuron_worker.speculation_gate import SpeculationGate, Verify, expected_tokens


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
    assert verifies(gate, 8, [(4, 0.1, 0)])  # no speculative pass of 12 (-> 16) tokens yet
    gate.record(8, 4, 0.012)
    assert not verifies(gate, 8, [(4, 0.9, 0)])  # no plain step of 8 rows yet
    gate.record(8, 0, 0.010)
    assert verifies(gate, 8, [(3, 0.9, 0)])  # 11 tokens share the 16-token shape: measured
    assert not verifies(gate, 8, [(4, 0.1, 0)])  # measured, and not worth it
    assert verifies(
        gate, 8, [(4, 0.1, 0), (5, 0.1, 0)]
    )  # 17 tokens: the 32-token shape, unmeasured
    assert not verifies(gate, 4, [(8, 0.9, 0)])  # 12 tokens, measured; no plain step of 4 rows
    assert not verifies(gate, 8, [])


def test_speculates_when_the_expected_tokens_pay_for_the_wider_step() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(8, 0, 0.010)
    gate.record(8, 8, 0.0137)  # a verify step 1.37x a plain one (the H200's)
    # Free text: two rows with 4 drafts each at 16% acceptance add 0.38 tokens to 8: no.
    assert not verifies(gate, 8, [(4, 0.16, 0), (4, 0.16, 0)])
    # Extraction: two rows at 80% add 4.7 tokens to 8: yes.
    assert verifies(gate, 8, [(4, 0.8, 0), (4, 0.8, 0)])


def test_every_probe_th_decision_takes_the_other_choice() -> None:
    gate = SpeculationGate(probe=4)
    gate.record(1, 0, 0.010)
    gate.record(1, 4, 0.100)
    decisions = [verifies(gate, 1, [(4, 0.5, 0)]) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2


def test_costs_are_medians_of_the_recent_measurements_by_shape() -> None:
    gate = SpeculationGate(window=3)
    gate.record(2, 0, 0.010)
    gate.record(2, 0, 0.020)
    gate.record(2, 3, 0.040)
    gate.record(2, 4, 0.020)
    assert gate.plain.get(2) == pytest.approx(0.015)
    assert gate.speculative.get(8) == pytest.approx(0.030)  # passes of 5 and 6 tokens
    assert gate.plain.get(1) is None and gate.speculative.get(4) is None
    for seconds in (0.012, 0.013, 0.011):
        gate.record(2, 0, seconds)  # the window keeps the last three
    assert gate.plain.get(2) == pytest.approx(0.012)


def test_one_slow_step_does_not_turn_the_gate() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(1, 0, 0.006)
    for _ in range(3):
        gate.record(1, 4, 0.008)  # verification passes at 1.33x a plain step
    assert verifies(gate, 1, [(4, 0.6, 0)])  # 2.3 tokens for 1.33x the cost
    gate.record(1, 4, 0.080)  # one pass that a neighbour stalled
    assert verifies(gate, 1, [(4, 0.6, 0)])
    gate.record(1, 4, 0.080)
    gate.record(1, 4, 0.080)  # a lasting change moves the median
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
    gate.record(8, 0, 0.010)
    tails = [(4, 0.9, 8), (4, 0.9, 8)]  # 8 pending + 8 drafts + 16 forced: a 32-token pass
    assert gate.decide(8, tails) == Verify.TAILS
    gate.record(8, 24, 0.020)
    assert gate.decide(8, tails) == Verify.DRAFTS  # a 16-token pass: not measured yet
    assert verifies(gate, 8, tails)


def test_a_tail_counts_the_step_it_saves_against_the_width_it_adds() -> None:
    """Two rows with 4 drafts at 90% expect 6.19 more sampled tokens; their tails, reached
    where all 4 drafts are accepted (0.66 each), save a step each: 1.31."""
    tails = [(4, 0.9, 8), (4, 0.9, 8)]
    gate = SpeculationGate(probe=1000)
    gate.record(8, 0, 0.010)  # plain: 800 tokens/s
    gate.record(8, 8, 0.012)  # drafts alone, 16 tokens: 14.19 / 12 ms = 1182 tokens/s
    gate.record(8, 24, 0.020)  # with tails, 32 tokens: 15.5 / 20 ms = 775 tokens/s
    assert gate.decide(8, tails) == Verify.DRAFTS  # where a pass costs about its width
    gate = SpeculationGate(probe=1000)
    gate.record(8, 0, 0.010)
    gate.record(8, 8, 0.012)
    gate.record(8, 24, 0.0125)  # 15.5 / 12.5 ms = 1240 tokens/s: wide passes cost little more
    assert gate.decide(8, tails) == Verify.TAILS
    gate = SpeculationGate(probe=1000)
    gate.record(8, 0, 0.010)
    gate.record(8, 8, 0.020)
    gate.record(8, 24, 0.030)
    assert gate.decide(8, [(4, 0.3, 8), (4, 0.3, 8)]) == Verify.NONE  # 8.85 / 20 ms, 8.87 / 30 ms
    assert not verifies(gate, 8, [(4, 0.3, 8), (4, 0.3, 8)])
