"""The device side of a sampling step: EOS banned for `ignore_eos` rows only, on steps with and
without such a row."""

from __future__ import annotations

import numpy as np
import torch

from neuron_worker.backends import Backend, create_backend
from neuron_worker.engine import EngineConfig
from neuron_worker.sampler import Sampler
from neuron_worker.step_device import SampleBatch, StepDevice
from tests.unit.worker.test_engine import TOK, FakeModel, V

EOS = TOK.eos_token_ids[0]
OTHER = 300  # the runner-up of every row


def device(backend: Backend) -> StepDevice:
    sampler = Sampler(
        vocab_size=V,
        logits_size=V + 64,
        max_rows=4,
        device="cpu",
        structured_outputs=True,
        compile=False,
    )
    return StepDevice(
        model=FakeModel(),
        backend=backend,
        sampler=sampler,
        config=EngineConfig(max_batch=4, max_seq_len=256, batch_buckets=(1, 2, 4)),
        eos_ids=tuple(TOK.eos_token_ids),
        words=TOK.words_per_row,
    )


def greedy(dev: StepDevice, ban: list[bool]) -> list[int]:
    """Greedy tokens of rows whose best token is EOS, `ban[i]`: row i ignores EOS."""
    n = len(ban)
    logits = torch.zeros(n, V + 64)
    logits[:, EOS], logits[:, OTHER] = 10.0, 5.0
    params = {"temperature": [0.0] * n, "top_p": [1.0] * n, "top_k": [0] * n}
    params |= {"seed": [0] * n, "offset": [0] * n}
    compact = np.empty((n, TOK.words_per_row), dtype=np.int32)
    batch = SampleBatch(compact, np.full(n, n), np.array(ban), params)
    return dev.sample(dev._hold(logits), batch).tokens


def test_only_rows_that_ignore_eos_lose_it() -> None:
    dev = device(create_backend("cpu"))
    assert greedy(dev, [False, False, False, False]) == [EOS] * 4
    assert greedy(dev, [False, True, False, True]) == [EOS, OTHER, EOS, OTHER]
    assert greedy(dev, [True, True]) == [OTHER, OTHER]
    assert greedy(dev, [False, False]) == [EOS, EOS]
