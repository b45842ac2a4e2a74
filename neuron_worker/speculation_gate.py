"""Whether a step's drafts are worth a verification pass, from the step costs measured so far.

A speculative step computes 1 + k positions for a row with k drafts, waits for the grammar before
its forward (no overlap) and samples every position; a plain step computes one position per row.
Where the drafts are seldom accepted, that costs more than it gains: free text on an H200 at c8
ran at 0.67x with speculation, the verify pass alone costing 1.37x a decode pass
(docs/benchmarks.md, "CUDA on an H200"). The gate compares the tokens the model samples per
second, for the step at hand,

    expected tokens / cost of a speculative step of its width   (each drafting row:
        1 + a + a^2 + ... + a^k for its k drafts, a its acceptance so far; other rows: 1)
    rows / cost of a plain step of its width

and speculates when the first is at least the second. Either step also forwards the grammar's
forced tokens (jump-forward, and the grammar's drafts after them): they widen both passes and
are no gain of either choice (they come whatever the gate decides, and need no step of their
own). A choice's width is its rows, the forced tokens steps have forwarded lately (`forced`),
and its drafts and expected tails corrected by what its recent passes forwarded of them
(`extra`: the grammar cuts drafts and tails).

What a row's forced tail (the grammar's drafts of the bytes it forces after a row's own drafts
that close a string: the next key) saves is the step that would carry those forced tokens and
sample after them: one token's worth, where all the row's drafts are accepted; it widens the
pass by up to `--forced-draft-tokens`. Where a pass costs about its width (fp32 on AVX2, a
neighbour taking a core) that costs more than the step, and counted whole the tails made the
gate decline the copies they follow (c1 constrained 1.06x against no speculation; 1.23x with
the copies verified alone). So the gate chooses among three (`Verify`): the drafts with their
tails, the drafts alone (no room for tails), or a plain step. Where the drafts are accepted, the
drafts alone leave their tail's tokens to the next step, which forwards them by jump-forward:
that share of the tails' width (`a^k` of each) is charged to the drafts alone too.

Costs are medians of recent measured step wall times by the tokens the pass forwarded (its
width), for steps with drafts of their own and without (`PassCosts`); a width not measured is
read off the line through the measured widths nearest to it, so a width no pass has had yet has
a cost as soon as two widths have one. Kept by batch size and by tokens rounded up to a power of
two instead, the costs misled the gate at c8 on the AVX2 code paths beside a busy process: a
plain step's cost held the forced tokens' width (107 ms against 52 ms for an 8-token pass), and
the tails' expected widths rounded to a 64-token shape no pass reached, tried at nearly every
other step (c8 constrained 0.86-0.89x against no speculation). A choice with no estimate yet is
tried (the drafts with their tails, then alone, then the plain step), and every `probe`
decisions one of the choices not taken is, in turn, so every estimate follows the load. Greedy
output does not depend on the gate (verification is exact), and neither does sampling: a
position's token is drawn with the same counter-based random number either way.

Drafting itself costs the step loop time (each row's drafter, the draft statistics, the gate's
decision: ~0.45 ms of a 15 ms step at 8 rows on 2 cores, where the passes' threads compete with
it). Where the gate keeps declining at a batch size (85-95% of its decisions at 8 constrained
rows on 2 AVX512-BF16 cores), that time buys nothing: c8 constrained read 0.87-0.90x against
no speculation. So after `DraftPause.patience` declines in a row at a batch size, that batch
size drafts nothing for a number of steps that doubles with each pause in a row (`DraftPause`);
a decision to verify ends the pauses (c8 constrained 0.99-1.02x; docs/benchmarks.md, "Drafting
where the gate may verify").
"""

from __future__ import annotations

import bisect
import enum
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


class Verify(enum.Enum):
    """What a step verifies (`SpeculationGate.decide`)."""

    TAILS = "drafts and the grammar's forced tails after them"
    DRAFTS = "drafts alone"
    NONE = "nothing: a plain step"


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a row with `k` drafts emits in expectation: the sampled one, plus each draft while
    all before it were accepted."""
    return sum(acceptance**i for i in range(k + 1))


class PassCosts:
    """Measured step wall times by pass width (tokens forwarded). A measured width's cost is the
    median of its last `window` measurements, so one step that a neighbour or a page fault
    slowed does not steer the gate (a declined choice is measured again only every `probe`
    decisions, so a moving average would carry such a spike for hundreds of steps). Another
    width's cost is on the line through the two measured widths nearest it (between them,
    or beside them, where the line never falls with width and never below a cost proportional
    to the width: a pass costs at least its share of the nearest one)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._seconds: dict[int, deque[float]] = {}
        self._widths: list[int] = []  # sorted keys of `_seconds`

    def __len__(self) -> int:
        """The widths measured."""
        return len(self._widths)

    def add(self, width: int, seconds: float) -> None:
        if width not in self._seconds:
            self._seconds[width] = deque(maxlen=self.window)
            bisect.insort(self._widths, width)
        self._seconds[width].append(seconds)

    def measured(self, width: int) -> float | None:
        """The median of the width's own measurements, None before its first."""
        times = self._seconds.get(width)
        return statistics.median(times) if times else None

    def get(self, width: int) -> float | None:
        """The width's cost: measured, or estimated from two measured widths (None before
        there are two)."""
        own = self.measured(width)
        if own is not None:
            return own
        ws = self._widths
        if len(ws) < 2:
            return None
        i = bisect.bisect_left(ws, width)
        if i == 0:
            lo, hi = ws[0], ws[1]
        elif i == len(ws):
            lo, hi = ws[-2], ws[-1]
        else:
            lo, hi = ws[i - 1], ws[i]
        c_lo, c_hi = self.measured(lo), self.measured(hi)
        assert c_lo is not None and c_hi is not None
        slope = max(0.0, (c_hi - c_lo) / (hi - lo))
        if width > hi:
            return c_hi + slope * (width - hi)
        if width < lo:
            return max(c_lo - slope * (lo - width), c_lo * width / lo)
        return c_lo + slope * (width - lo)


# The gate's declines in a row at a batch size before drafting pauses there (`DraftPause`).
PAUSE_DECLINES = 4


@dataclass
class DraftPause:
    """Whether a batch size drafts this step: not for `first` steps after `patience` declines
    in a row, twice as long after each further pause in a row (`most` at most), again as soon as
    the gate decides to verify."""

    patience: int = PAUSE_DECLINES
    first: int = 4
    most: int = 32
    declines: int = 0  # in a row, since the last pause or decision to verify
    left: int = 0  # steps left without drafting
    pauses: int = 0  # in a row

    def drafting(self) -> bool:
        """Whether this step drafts (counts a paused step down)."""
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def decided(self, verify: bool) -> None:
        """The gate's best choice for a step with drafts: to verify some, or not."""
        if verify:
            self.declines = self.pauses = 0
            return
        self.declines += 1
        if self.declines >= self.patience:
            self.left = min(self.first << self.pauses, self.most)
            self.pauses += 1
            self.declines = 0


@dataclass
class SpeculationGate:
    """Step-cost model and decision (module docstring). `window`: the measurements per width
    whose median is its cost (`PassCosts`). `probe`: every how many decisions a choice not the
    best is taken. `pause`: declines in a row before a batch size pauses drafting (0: never;
    `DraftPause`)."""

    window: int = 5
    probe: int = 128
    pause: int = PAUSE_DECLINES
    decisions: int = 0
    # The grammar's forced tokens per step, whatever the choice (jump-forward tokens and forced
    # drafts after them), and per choice that verifies drafts the tokens those forwarded beyond
    # what it was chosen with (the grammar cuts drafts and tails): moving averages, as forced
    # tokens come and go with the outputs.
    forced: float = 0.0
    extra: dict[Verify, float] = field(
        default_factory=lambda: {Verify.TAILS: 0.0, Verify.DRAFTS: 0.0}
    )
    plain: PassCosts = field(init=False)
    speculative: PassCosts = field(init=False)
    # The last decision and the drafts and tails it expected, until the step is recorded.
    _chosen: tuple[Verify, float] | None = field(default=None, init=False, repr=False)
    _pauses: dict[int, DraftPause] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.plain = PassCosts(self.window)
        self.speculative = PassCosts(self.window)

    def drafting(self, rows: int) -> bool:
        """Whether a step of `rows` rows drafts at all (module docstring, `DraftPause`)."""
        pause = self._pauses.get(rows)  # none where the gate never pauses (`pause` 0)
        return pause is None or pause.drafting()

    def decide(self, rows: int, drafts: Sequence[tuple[int, float, float]]) -> Verify:
        """What to verify this step: `rows` in the batch, and for each row with drafts their
        number, the row's acceptance estimate and how many tokens the grammar is expected to
        force after them (its tail, module docstring). A choice without a cost estimate yet is
        tried first: the drafts with their tails, then alone, then a plain step."""
        n = sum(k for k, _, _ in drafts)
        tail = sum(t for _, _, t in drafts)
        added = {Verify.TAILS: n + tail, Verify.DRAFTS: float(n), Verify.NONE: 0.0}
        choice = self._choose(rows, drafts, added) if n else Verify.NONE
        self._chosen = (choice, added[choice])
        return choice

    def _choose(
        self,
        rows: int,
        drafts: Sequence[tuple[int, float, float]],
        added: dict[Verify, float],
    ) -> Verify:
        tail = added[Verify.TAILS] > added[Verify.DRAFTS]
        # A pass forwards at least a token per row, whatever the averages say (a cost read off
        # the line below the narrowest measured width can reach 0 there).
        cost = {
            c: (self.plain if c == Verify.NONE else self.speculative).get(
                max(rows, round(rows + self.forced + a + self.extra.get(c, 0.0)))
            )
            for c, a in added.items()
        }
        if tail and cost[Verify.TAILS] is None:
            return Verify.TAILS
        if cost[Verify.DRAFTS] is None:
            return Verify.DRAFTS
        if cost[Verify.NONE] is None:
            return Verify.NONE
        gain = sum(expected_tokens(k, a) - 1 for k, a, _ in drafts)
        # Sampled tokens per second of each choice; the tails' step saved counts where every
        # draft before them is accepted.
        tokens = {Verify.DRAFTS: rows + gain, Verify.NONE: float(rows)}
        known = {c: seconds for c, seconds in cost.items() if seconds is not None}
        if tail:
            reached = sum(a**k * t for k, a, t in drafts)  # tail tokens after accepted drafts
            tokens[Verify.TAILS] = rows + gain + sum(a**k for k, a, t in drafts if t > 0)
            # Without its tail, a row whose drafts are accepted forwards those tokens in the
            # next step (jump-forward): the drafts alone defer that part of the tails' width.
            deferred = reached / (added[Verify.TAILS] - added[Verify.DRAFTS])
            known[Verify.DRAFTS] += deferred * max(0.0, known[Verify.TAILS] - known[Verify.DRAFTS])
        rates = {c: tokens[c] / known[c] for c in Verify if c in tokens}
        best = max(rates, key=rates.__getitem__)  # ties: the first (more verified)
        if self.pause:
            pause = self._pauses.get(rows)
            if pause is None:
                pause = self._pauses[rows] = DraftPause(patience=self.pause)
            pause.decided(best != Verify.NONE)
        self.decisions += 1
        if self.decisions % self.probe == 0:
            others = [c for c in rates if c != best]
            return others[(self.decisions // self.probe) % len(others)]
        return best

    def record(self, rows: int, width: int, own: int, seconds: float) -> None:
        """A step of `rows` rows that forwarded `width` tokens, `own` of them drafts of its own
        and the grammar's tails after them (0: a plain step, the forced tokens only), took
        `seconds`."""
        (self.speculative if own else self.plain).add(width, seconds)
        # Rows dropped after the grammar's answer (finished, aborted) forward nothing: no
        # negative forced tokens.
        self.forced += 0.2 * (max(0, width - rows - own) - self.forced)
        choice, expected = self._chosen or (Verify.NONE, 0.0)  # no drafts: no decision
        self._chosen = None
        if choice != Verify.NONE:
            self.extra[choice] += 0.2 * (own - expected - self.extra[choice])
