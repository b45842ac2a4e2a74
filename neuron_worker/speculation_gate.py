"""Whether a step's drafts are worth a verification pass, from the step costs measured so far.

A speculative step computes 1 + k positions for a row with k drafts, waits for the grammar before
its forward (no overlap) and samples every position; a plain step computes one position per row.
Where the drafts are seldom accepted, that costs more than it gains: free text on an H200 at c8
ran at 0.67x with speculation, the verify pass alone costing 1.37x a decode pass
(docs/benchmarks.md, "CUDA on an H200"). The gate compares the tokens the model samples per
second, for the step at hand,

    expected tokens / cost of a speculative step of this shape   (each drafting row:
        1 + a + a^2 + ... + a^k for its k drafts, a its acceptance so far; other rows: 1)
    rows / cost of a plain step of this batch size

and speculates when the first is at least the second. The grammar's forced tokens are no gain of
either choice: a verification pass carries those that follow a row's drafts, a plain step gets
the same ones by jump-forward a step later (its measured cost includes those passes). Counting
them for speculation alone made constrained batches at c8 speculate at 0.92x the tokens/s
without it. Costs are medians of recent measured step
wall times, for plain steps by batch size and for speculative steps by the tokens of their pass
(rows + drafts + the grammar's expected forced drafts, rounded up to a power of two: what a pass
costs is mostly a function of its tokens, flat on a launch-bound device, growing on a
compute-bound one; few shapes keep the exploration short). A shape not measured yet is tried (a
speculative shape first, then the plain one), and every `probe` decisions the other choice is
taken once, so both estimates follow the load. Greedy output does not depend on the gate
(verification is exact), and neither does sampling: a position's token is drawn with the same
counter-based random number either way.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from neuron_worker.scheduler import next_pow2


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a row with `k` drafts emits in expectation: the sampled one, plus each draft while
    all before it were accepted."""
    return sum(acceptance**i for i in range(k + 1))


class StepCosts:
    """Measured step wall times by shape: each shape's cost is the median of its last `window`
    measurements, so one step that a neighbour or a page fault slowed does not steer the gate
    (a declined choice is measured again only every `probe` decisions, so a moving average would
    carry such a spike for hundreds of steps)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._seconds: dict[int, deque[float]] = {}

    def add(self, key: int, seconds: float) -> None:
        self._seconds.setdefault(key, deque(maxlen=self.window)).append(seconds)

    def get(self, key: int) -> float | None:
        """The shape's cost, None before its first measurement."""
        measured = self._seconds.get(key)
        return statistics.median(measured) if measured else None


@dataclass
class SpeculationGate:
    """Step-cost model and decision (module docstring). `window`: the measurements per shape
    whose median is its cost (`StepCosts`). `probe`: every how many decisions the other choice
    is taken."""

    window: int = 5
    probe: int = 128
    decisions: int = 0
    plain: StepCosts = field(init=False)
    speculative: StepCosts = field(init=False)

    def __post_init__(self) -> None:
        self.plain = StepCosts(self.window)
        self.speculative = StepCosts(self.window)

    def worth_it(self, rows: int, drafts: Sequence[tuple[int, float, float]]) -> bool:
        """Whether to verify this step's drafts: `rows` in the batch, and for each row with
        drafts their number, the row's acceptance estimate and how many tokens the grammar is
        expected to force after them (they widen the pass; they are no gain, module docstring)."""
        n = sum(k for k, _, _ in drafts)
        if n == 0:
            return False
        tail = sum(t for _, _, t in drafts)
        spec = self.speculative.get(next_pow2(rows + n + round(tail)))
        plain = self.plain.get(rows)
        if spec is None:
            return True
        if plain is None:
            return False
        gain = sum(expected_tokens(k, a) - 1 for k, a, _ in drafts)
        worth = (rows + gain) * plain >= rows * spec
        self.decisions += 1
        return not worth if self.decisions % self.probe == 0 else worth

    def record(self, rows: int, drafts: int, seconds: float) -> None:
        """A step of `rows` rows verifying `drafts` drafts (0: a plain step) took `seconds`."""
        if drafts > 0:
            self.speculative.add(next_pow2(rows + drafts), seconds)
        else:
            self.plain.add(rows, seconds)
