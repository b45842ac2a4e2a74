"""The device side of a sampling step: EOS banned for `ignore_eos` rows only, on steps with and
without such a row; the warm-up and the logprob call hand the sampler's graphs what serving
does (inference tensors, two distinct logits), so that serving never compiles them again."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from neuron_worker.backends import Backend, create_backend
from neuron_worker.engine import EngineConfig
from neuron_worker.greedy_kernel import GreedyKernel
from neuron_worker.sampler import Sampler
from neuron_worker.sampling_rows import PAD_ROW, SamplingRows
from neuron_worker.step_device import SampleBatch, StepDevice
from tests.unit.worker.test_engine import TOK, FakeModel, V

EOS = TOK.eos_token_ids[0]
OTHER = 300  # the runner-up of every row


def device(
    backend: Backend,
    sampler_type: type[Sampler] = Sampler,
    *,
    rows: int = 4,
    vocab_size: int = V,
    structured: bool = True,
    greedy: GreedyKernel | None = None,
) -> StepDevice:
    """An eager device over the stand-in model, logits 64 columns wider than the vocabulary,
    batches of up to `rows` (a power of two)."""
    sampler = sampler_type(
        vocab_size=vocab_size,
        logits_size=V + 64,
        max_rows=rows,
        device="cpu",
        structured_outputs=structured,
        compile=False,
    )
    buckets = tuple(1 << i for i in range(rows.bit_length()))
    return StepDevice(
        model=FakeModel(),
        backend=backend,
        sampler=sampler,
        config=EngineConfig(
            max_batch=rows,
            max_seq_len=256,
            batch_buckets=buckets,
            structured_outputs=structured,
        ),
        eos_ids=tuple(TOK.eos_token_ids),
        words=TOK.words_per_row,
        greedy=greedy,
    )


def greedy(dev: StepDevice, ban: list[bool]) -> list[int]:
    """Greedy tokens of rows whose best token is EOS, `ban[i]`: row i ignores EOS."""
    n = len(ban)
    logits = torch.zeros(n, V + 64)
    logits[:, EOS], logits[:, OTHER] = 10.0, 5.0
    compact = np.empty((n, TOK.words_per_row), dtype=np.int32)
    batch = SampleBatch(compact, np.full(n, n), np.array(ban), SamplingRows([PAD_ROW] * n))
    return dev.sample(dev._hold(logits), batch).tokens


def test_only_rows_that_ignore_eos_lose_it() -> None:
    dev = device(create_backend("cpu"))
    assert greedy(dev, [False, False, False, False]) == [EOS] * 4
    assert greedy(dev, [False, True, False, True]) == [EOS, OTHER, EOS, OTHER]
    assert greedy(dev, [True, True]) == [OTHER, OTHER]
    assert greedy(dev, [False, False]) == [EOS, EOS]


class CopyingBackend(Backend):
    """A CPU backend whose host-to-device copy really copies, as CUDA's does."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()


class RecordingSampler(Sampler):
    """Records what the compiled graphs would be guarded on: whether the logits are inference
    tensors (a forward's are) and whether the logprob graph's two logits inputs are one tensor."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.inference: list[bool] = []
        self.aliased: list[bool] = []

    def __call__(self, logits: torch.Tensor, *args: Any) -> torch.Tensor:
        self.inference.append(logits.is_inference())
        return super().__call__(logits, *args)

    def logprobs(self, raw: torch.Tensor, processed: torch.Tensor, *args: Any) -> Any:
        self.inference += [raw.is_inference(), processed.is_inference()]
        self.aliased.append(raw is processed)
        return super().logprobs(raw, processed, *args)


def recording_device(backend: Backend) -> tuple[StepDevice, RecordingSampler]:
    dev = device(backend, RecordingSampler)
    assert isinstance(dev.sampler, RecordingSampler)
    dev.setup()
    return dev, dev.sampler


def test_warm_up_feeds_the_sampler_what_serving_does() -> None:
    """The sampler's graphs are guarded on their inputs' dispatch keys and on inputs aliasing:
    the warm-up must hand them inference tensors (also through a copying device) and two
    distinct logits to the logprob graph, or serving compiles them again."""
    for backend in (create_backend("cpu"), CopyingBackend()):
        dev, sampler = recording_device(backend)
        dev.warmup(lambda label: None)
        assert sampler.inference and all(sampler.inference), type(backend).__name__
        assert sampler.aliased and not any(sampler.aliased)


def test_logprobs_get_two_tensors_on_a_step_without_a_ban_or_penalty() -> None:
    dev, sampler = recording_device(create_backend("cpu"))
    n = 2
    with torch.inference_mode():
        logits = torch.zeros(n, V + 64)
    compact = np.empty((n, TOK.words_per_row), dtype=np.int32)
    rows = dev._warmup_rows(n)
    rows.any_penalty = False
    batch = SampleBatch(compact, np.full(n, n), np.zeros(n, dtype=bool), rows)
    out = dev.sample(dev._hold(logits), batch)
    assert len(out.logprobs) == n
    assert sampler.aliased == [False] and all(sampler.inference)
