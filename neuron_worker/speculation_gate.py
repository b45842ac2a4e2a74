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
without it. What a row's forced tail (the grammar's drafts of the bytes it forces after a
row's own drafts that close a string: the next key) saves is the step that would carry those
forced tokens and sample after them: one token's worth, where all the row's drafts are
accepted; it widens the pass by up to `--forced-draft-tokens`. Where a pass costs about its
width (fp32 on AVX2, a neighbour taking a core) that costs more than the step, and counted whole
the tails made the gate decline the copies they follow (c1 constrained 1.06x against no
speculation; 1.23x with the copies verified alone). So the gate chooses among three (`Verify`):
the drafts with their tails, the drafts alone (no room for tails), or a plain step.

Costs are medians of recent measured step wall times, for plain steps by batch size and for
speculative steps by the tokens of their pass (rows + drafts + the grammar's expected forced
drafts, rounded up to a power of two: what a pass costs is mostly a function of its tokens, flat
on a launch-bound device, growing on a compute-bound one; few shapes keep the exploration short).
A shape not measured yet is tried (the drafts with their tails, then alone, then the plain
step), and every `probe` decisions one of the choices not taken is, in turn, so every estimate
follows the load. Greedy output does not depend on the gate
(verification is exact), and neither does sampling: a position's token is drawn with the same
counter-based random number either way.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from neuron_worker.scheduler import next_pow2


class Verify(enum.Enum):
    """What a step verifies (`SpeculationGate.decide`)."""

    TAILS = "drafts and the grammar's forced tails after them"
    DRAFTS = "drafts alone"
    NONE = "nothing: a plain step"


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
    whose median is its cost (`StepCosts`). `probe`: every how many decisions a choice not the
    best is taken."""

    window: int = 5
    probe: int = 128
    decisions: int = 0
    plain: StepCosts = field(init=False)
    speculative: StepCosts = field(init=False)

    def __post_init__(self) -> None:
        self.plain = StepCosts(self.window)
        self.speculative = StepCosts(self.window)

    def decide(self, rows: int, drafts: Sequence[tuple[int, float, float]]) -> Verify:
        """What to verify this step: `rows` in the batch, and for each row with drafts their
        number, the row's acceptance estimate and how many tokens the grammar is expected to
        force after them (its tail, module docstring). A shape not measured yet is tried first:
        the drafts with their tails, then alone, then a plain step."""
        n = sum(k for k, _, _ in drafts)
        if n == 0:
            return Verify.NONE
        tail = sum(t for _, _, t in drafts)
        with_tails = self.speculative.get(next_pow2(rows + n + round(tail)))
        alone = self.speculative.get(next_pow2(rows + n))
        plain = self.plain.get(rows)
        if tail > 0 and with_tails is None:
            return Verify.TAILS
        if alone is None:
            return Verify.DRAFTS
        if plain is None:
            return Verify.NONE
        gain = sum(expected_tokens(k, a) - 1 for k, a, _ in drafts)
        # Tokens per second of each choice; the tails' step saved counts where every draft
        # before them is accepted.
        rates = {}
        if tail > 0:
            assert with_tails is not None
            saved = sum(a**k for k, a, t in drafts if t > 0)
            rates[Verify.TAILS] = (rows + gain + saved) / with_tails
        rates[Verify.DRAFTS] = (rows + gain) / alone
        rates[Verify.NONE] = rows / plain
        best = max(rates, key=rates.__getitem__)  # ties: the first (more verified)
        self.decisions += 1
        if self.decisions % self.probe == 0:
            others = [c for c in rates if c != best]
            return others[(self.decisions // self.probe) % len(others)]
        return best

    def record(self, rows: int, drafts: int, seconds: float) -> None:
        """A step of `rows` rows verifying `drafts` drafts (0: a plain step) took `seconds`."""
        if drafts > 0:
            self.speculative.add(next_pow2(rows + drafts), seconds)
        else:
            self.plain.add(rows, seconds)
