"""The greedy kernel (`neuron_worker.greedy_kernel`) picks the token the sampler's greedy graph
picks, bit for bit: under dense, sparse, empty and missing mask rows, with EOS banned or not,
with ties, NaN and -inf logits, a vocabulary that ends inside a mask word, padding rows; and a
device samples only the steps it may take through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_worker import kernels
from neuron_worker.backends import create_backend
from neuron_worker.greedy_kernel import GreedyKernel
from neuron_worker.sampler import NO_TOKEN
from neuron_worker.sampling_rows import PAD_ROW, SamplingRow, SamplingRows
from neuron_worker.step_device import SampleBatch, StepDevice
from tests.unit.worker.test_engine import TOK
from tests.unit.worker.test_step_device import device as step_device

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="the worker's kernels do not run here"
)

EOS = tuple(TOK.eos_token_ids)
LOGITS = TOK.vocab_size + 64  # the model's logits row is wider than the tokenizer's vocabulary
WORDS = TOK.words_per_row


class Counting(GreedyKernel):
    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        super().__init__(vocab_size, eos_ids)
        self.calls = 0

    def __call__(self, *args: object, **kw: object) -> list[int]:
        self.calls += 1
        return super().__call__(*args, **kw)  # type: ignore[arg-type]


def device(
    greedy: GreedyKernel | None, *, vocab_size: int = TOK.vocab_size, structured: bool = True
) -> StepDevice:
    return step_device(
        create_backend("cpu"), rows=8, vocab_size=vocab_size, structured=structured, greedy=greedy
    )


def random_step(rng: np.random.Generator, case: int) -> tuple[torch.Tensor, SampleBatch]:
    """Logits and mask rows of one step, with every hazard some of the time."""
    n = int(rng.integers(1, 9))
    logits = torch.from_numpy(rng.standard_normal((n, LOGITS), dtype=np.float32))
    if case % 3 == 0:  # ties: the first column with the largest value wins
        logits = logits.mul(2).round()
    if case % 5 == 0:  # NaN counts as the largest value (torch.argmax)
        logits[:, rng.integers(0, LOGITS, 40)] = float("nan")
    if case % 7 == 0:  # nothing above -inf: column 0 where the mask allows it
        logits[:] = float("-inf")
    compact = rng.integers(-(2**31), 2**31, (n, WORDS), dtype=np.int64).astype(np.int32)
    if case % 4 == 0:  # sparse rows: a few tokens allowed
        compact[:] = 0
        compact[:, rng.integers(0, WORDS, 3)] = rng.integers(1, 2**31, 3, dtype=np.int64)
    if case % 6 == 0:
        compact[:, 0] |= 1  # column 0 allowed
    if case % 11 == 0:
        compact[0] = 0  # a row that allows nothing: NO_TOKEN
    # Some rows get no mask row (unconstrained), and one mask row may be dropped (dest n).
    with_rows = int(rng.integers(0, n + 1))
    dest = np.full(n, n, dtype=np.int64)
    dest[:with_rows] = rng.permutation(n)[:with_rows]
    ban = rng.random(n) < 0.5
    if case % 2:  # EOS the best column of every row, banned or not
        logits[:, list(EOS)] = 1e4
    sampled = int(rng.integers(1, n + 1))  # the rest are padding rows
    rows = SamplingRows([PAD_ROW] * sampled)
    return logits, SampleBatch(compact, dest, ban, rows)


def sample(dev: StepDevice, logits: torch.Tensor, batch: SampleBatch) -> list[int]:
    return dev.sample(dev._hold(logits.clone()), batch).tokens


@pytest.mark.parametrize("vocab_size", [TOK.vocab_size, TOK.vocab_size - 5])
def test_the_kernel_picks_the_greedy_graphs_token(vocab_size: int) -> None:
    """`vocab_size - 5`: the vocabulary ends inside a mask word (its last columns never win)."""
    kernel = Counting(vocab_size, EOS)
    fast, graphs = device(kernel, vocab_size=vocab_size), device(None, vocab_size=vocab_size)
    rng = np.random.default_rng(vocab_size)
    for case in range(120):
        logits, batch = random_step(rng, case)
        want = sample(graphs, logits, batch)
        got = sample(fast, logits, batch)
        sampled = len(batch.rows.rows)
        assert got[:sampled] == want[:sampled], case
        assert got[sampled:] == [NO_TOKEN] * (len(got) - sampled)  # padding rows: not sampled
    assert kernel.calls == 120


def test_the_edge_cases_by_name() -> None:
    kernel = GreedyKernel(TOK.vocab_size, EOS)
    n = 5
    logits = torch.zeros(n, LOGITS)
    logits[0, 7] = logits[0, 9] = 3.0  # a tie: the first
    logits[1, 100], logits[1, 50] = float("nan"), 1e9  # NaN beats every number
    logits[2] = float("-inf")  # nothing above -inf, column 0 allowed: column 0
    logits[3] = float("-inf")  # ... column 0 not allowed: no token
    logits[4, list(EOS)], logits[4, 40] = 9.0, 8.0  # EOS banned: the runner-up
    logits[:, TOK.vocab_size :] = 1e9  # past the vocabulary: never
    compact = np.full((n, WORDS), -1, dtype=np.int32)
    compact[3, 0] = ~1  # column 0 not allowed
    dest = np.arange(n, dtype=np.int64)
    ban = np.array([False, False, False, False, True])
    assert kernel(logits, compact, dest, ban, n) == [7, 100, 0, NO_TOKEN, 40]


def test_only_all_greedy_steps_without_extras_take_the_kernel() -> None:
    kernel = Counting(TOK.vocab_size, EOS)
    dev = device(kernel)
    dev.setup()  # the penalty table
    n = 4
    logits = torch.randn(n, LOGITS)
    compact = np.empty((n, WORDS), dtype=np.int32)
    dest = np.full(n, n, dtype=np.int64)
    ban = np.zeros(n, dtype=bool)

    def step(rows: SamplingRows) -> None:
        dev.sample(dev._hold(logits.clone()), SampleBatch(compact, dest, ban, rows))

    step(SamplingRows([SamplingRow(), PAD_ROW]))
    assert kernel.calls == 1
    step(SamplingRows([SamplingRow(temperature=0.7, seed=1), PAD_ROW]))  # a sampled row
    step(SamplingRows([SamplingRow(slot=0)], any_penalty=True, count=[(0, 5)]))
    step(SamplingRows([SamplingRow()], any_logprobs=True))
    assert kernel.calls == 1


def test_without_structured_outputs_every_row_is_unconstrained() -> None:
    """No mask rows reach the sampler then, whatever the batch's compact rows hold."""
    fast, graphs = (
        device(GreedyKernel(TOK.vocab_size, EOS), structured=False),
        device(None, structured=False),
    )
    logits = torch.randn(2, LOGITS)
    compact = np.zeros((2, WORDS), dtype=np.int32)  # would allow nothing
    batch = SampleBatch(
        compact, np.arange(2, dtype=np.int64), np.zeros(2, dtype=bool), SamplingRows([PAD_ROW] * 2)
    )
    want = sample(graphs, logits, batch)
    assert sample(fast, logits, batch) == want == logits[:, : TOK.vocab_size].argmax(-1).tolist()
