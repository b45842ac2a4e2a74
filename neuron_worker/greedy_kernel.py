"""Greedy steps sampled in one C++ call (`kernels/greedy_tokens.cpp`) instead of the sampler's
graphs.

A step whose rows are all greedy and ask for no penalty and no logprob needs only each row's
first largest allowed logit. The sampler's route to it (scatter the compact mask rows, build the
parameter tensors, unpack the mask, `where`, `argmax`, check) is a handful of small ops that,
right after a forward pass has pushed everything out of the caches, cost ~0.45 ms of a ~5 ms
one-row step on a 2-core host; the kernel reads each row once (docs/benchmarks.md). It picks the
same token as the greedy graph after the EOS ban, bit for bit (NaN, -inf and ties included), so
a step may take either route.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from neuron_worker import kernels
from neuron_worker.sampling_rows import SamplingRows

__all__ = ["GreedyKernel"]


class GreedyKernel:
    """Samples all-greedy steps on a CPU where the worker's kernels are loaded."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        """``vocab_size``: the tokenizer's (columns past it are never sampled); ``eos_ids``: the
        columns banned for rows that ignore EOS."""
        self.vocab_size = vocab_size
        self._eos = torch.tensor(eos_ids, dtype=torch.int64)

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether the kernel runs on `device` here (a CPU with the worker's kernels loaded)."""
        return device.type == "cpu" and kernels.available()

    @staticmethod
    def takes(rows: SamplingRows) -> bool:
        """Whether a step's rows are all greedy (temperature 0) with no penalty or logprob."""
        if rows.any_penalty or rows.any_logprobs:
            return False
        return all(r.temperature <= 0.0 for r in rows.rows)

    def __call__(
        self,
        logits: Tensor,
        compact: np.ndarray,
        dest: np.ndarray,
        ban_eos: np.ndarray,
        sampled_rows: int,
    ) -> list[int]:
        """One token per row of ``logits`` ``[N, L]``: the first ``sampled_rows`` rows greedy
        under their mask rows (``compact[k]`` goes to row ``dest[k]``; ``dest >= N`` drops it;
        rows without one allow everything) and EOS ban; the rest, padding, ``NO_TOKEN``."""
        tokens: Tensor = torch.ops.maskwire_kernels.greedy_tokens(
            logits.to(torch.float32).contiguous(),
            torch.from_numpy(np.ascontiguousarray(compact, dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(dest, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(ban_eos, dtype=np.bool_)),
            self._eos,
            sampled_rows,
            self.vocab_size,
        )
        out: list[int] = tokens.tolist()
        return out
