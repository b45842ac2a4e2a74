"""The speculation gate's cost model and decision (`neuron_worker.speculation_gate`)."""

from __future__ import annotations

import pytest

from neuron_worker.drafter import DraftBudget, DraftConfig
from neuron_worker.speculation_gate import SpeculationGate, expected_tokens


def test_expected_tokens_counts_each_draft_while_all_before_it_are_accepted() -> None:
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(4, 0.0) == 1.0
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


def test_unmeasured_shapes_are_tried_first() -> None:
    gate = SpeculationGate()
    assert gate.worth_it(8, [(4, 0.1, 0)])  # no speculative pass of 12 (-> 16) tokens yet
    gate.record(8, 4, 0.012)
    assert not gate.worth_it(8, [(4, 0.9, 0)])  # no plain step of 8 rows yet
    gate.record(8, 0, 0.010)
    assert gate.worth_it(8, [(3, 0.9, 0)])  # 11 tokens share the 16-token shape: measured
    assert not gate.worth_it(8, [(4, 0.1, 0)])  # measured, and not worth it
    assert gate.worth_it(8, [(4, 0.1, 0), (5, 0.1, 0)])  # 17 tokens: the 32-token shape, unmeasured
    assert not gate.worth_it(4, [(8, 0.9, 0)])  # 12 tokens, measured; no plain step of 4 rows
    assert not gate.worth_it(8, [])


def test_speculates_when_the_expected_tokens_pay_for_the_wider_step() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(8, 0, 0.010)
    gate.record(8, 8, 0.0137)  # a verify step 1.37x a plain one (the H200's)
    # Free text: two rows with 4 drafts each at 16% acceptance add 0.38 tokens to 8: no.
    assert not gate.worth_it(8, [(4, 0.16, 0), (4, 0.16, 0)])
    # Extraction: two rows at 80% add 4.7 tokens to 8: yes.
    assert gate.worth_it(8, [(4, 0.8, 0), (4, 0.8, 0)])


def test_every_probe_th_decision_takes_the_other_choice() -> None:
    gate = SpeculationGate(probe=4)
    gate.record(1, 0, 0.010)
    gate.record(1, 4, 0.100)
    decisions = [gate.worth_it(1, [(4, 0.5, 0)]) for _ in range(8)]
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
    assert gate.worth_it(1, [(4, 0.6, 0)])  # 2.3 tokens for 1.33x the cost
    gate.record(1, 4, 0.080)  # one pass that a neighbour stalled
    assert gate.worth_it(1, [(4, 0.6, 0)])
    gate.record(1, 4, 0.080)
    gate.record(1, 4, 0.080)  # a lasting change moves the median
    assert not gate.worth_it(1, [(4, 0.6, 0)])


def test_a_budgets_acceptance_estimate_follows_its_verifications() -> None:
    budget = DraftBudget(DraftConfig(num_draft_tokens=4))
    assert budget.acceptance() == 0.5  # the prior: one accepted, one rejected
    budget.record(4, 4)  # all accepted: no rejection
    budget.record(4, 2)  # two accepted, then a rejection; the one before weighs 0.7
    assert budget.acceptance() == pytest.approx((4.8 + 1) / (4.8 + 1 + 2))
    for _ in range(8):
        budget.record(1, 0)  # a run of misses: the estimate follows them down
    assert budget.acceptance() < 0.25


def test_the_grammars_forced_tail_widens_the_pass_but_is_no_gain() -> None:
    gate = SpeculationGate(probe=1000)
    gate.record(8, 0, 0.010)
    gate.record(8, 24, 0.020)  # passes of 17-32 tokens cost two plain steps
    # Two rows with 4 drafts at 90% add 6.8 sampled tokens to 8: not worth twice the cost,
    # whatever the grammar forces after them (a plain step gets those by jump-forward).
    assert not gate.worth_it(8, [(4, 0.9, 8), (4, 0.9, 8)])
    gate.record(8, 8, 0.012)  # passes of 9-16 tokens, measured cheap
    assert gate.worth_it(8, [(4, 0.9, 0), (4, 0.9, 0)])
    # The tails take the same drafts' pass to 32 tokens: its cost decides.
    assert not gate.worth_it(8, [(4, 0.9, 8), (4, 0.9, 8)])
