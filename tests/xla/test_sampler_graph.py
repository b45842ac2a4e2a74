"""The masked sampler as an XLA graph (in-process): mask input present only with structured
outputs, packed masks unpacked on the device bit-exactly, no recompilation across steps."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch_xla

from neuron_worker.masks import scatter_mask_rows, words_per_row
from neuron_worker.sampler import Sampler, SamplingTensors
from neuron_worker.xla import compile_stats

pytestmark = pytest.mark.xla

V = 1000  # tokenizer vocabulary (W = 32 words, the last one partly padding)
L = 1024  # logits columns (padded embeddings)
N = 4
W = words_per_row(V)


def _sampler(structured: bool) -> Sampler:
    return Sampler(
        vocab_size=V,
        logits_size=L,
        max_rows=N,
        device=torch_xla.device(),
        structured_outputs=structured,
        compile=False,
    )


def _params(n: int, *, temperature: float = 0.0, seed: int = 0) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[temperature] * n,
        top_p=[1.0] * n,
        top_k=[0] * n,
        seed=[seed + i for i in range(n)],
        offset=[3] * n,
        n_rows=n,
        device=torch_xla.device(),
    )


def _step(
    sampler: Sampler, logits: torch.Tensor, compact: np.ndarray | None, dest: np.ndarray | None
) -> tuple[torch.Tensor, str]:
    """One sampling graph as the engine builds it; returns (tokens, the graph's HLO text)."""
    dev = torch_xla.device()
    with torch.no_grad():
        mask = None
        if compact is not None and dest is not None:
            mask = scatter_mask_rows(
                torch.from_numpy(compact).to(dev), torch.from_numpy(dest).to(dev), N
            )
        out = sampler(logits.to(dev), mask, _params(N))
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
        torch_xla.sync()
    return out.cpu(), hlo


def _parameters(hlo: str) -> list[str]:
    """Shapes of the entry computation's parameters."""
    entry = hlo[hlo.index("ENTRY") :]
    return re.findall(r"(\w+\[[\d,]*\])\{?[\d,]*\}? parameter\(", entry)


def _random_masks(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Rows 0 and 2 constrained (compact rows 0 and 1), rows 1 and 3 free; compact padded."""
    compact = rng.integers(-(2**31), 2**31, size=(N, W), dtype=np.int64).astype(np.int32)
    return compact, np.array([2, 0, N, N], dtype=np.int64)


def test_mask_is_a_graph_input_only_with_structured_outputs() -> None:
    logits = torch.randn(N, L)
    compact, dest = _random_masks(np.random.default_rng(0))
    _, with_mask = _step(_sampler(True), logits, compact, dest)
    _, without = _step(_sampler(False), logits, None, None)
    assert f"s32[{N},{W}]" in _parameters(with_mask)  # packed int32 rows, unpacked in the graph
    assert not any(p.startswith("s32[") for p in _parameters(without)), _parameters(without)
    assert "pred[" not in " ".join(_parameters(with_mask))  # no bool mask crosses to the device


def test_masked_greedy_matches_cpu_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    xla_sampler = _sampler(True)
    cpu_sampler = Sampler(
        vocab_size=V,
        logits_size=L,
        max_rows=N,
        device="cpu",
        structured_outputs=True,
        compile=False,
    )
    for _ in range(5):
        logits = torch.randn(N, L)
        compact, dest = _random_masks(rng)
        got, _ = _step(xla_sampler, logits, compact, dest)
        mask = scatter_mask_rows(torch.from_numpy(compact), torch.from_numpy(dest), N)
        params = SamplingTensors.build(
            temperature=[0.0] * N,
            top_p=[1.0] * N,
            top_k=[0] * N,
            seed=list(range(N)),
            offset=[3] * N,
            n_rows=N,
        )
        want = cpu_sampler(logits, mask, params)
        assert got.tolist() == want.tolist()
        # The chosen token is allowed by its row's mask; free rows take the plain argmax.
        for row, c in ((2, 0), (0, 1)):
            tok = int(got[row])
            assert tok < V and (int(compact[c, tok // 32]) >> (tok % 32)) & 1
        assert int(got[1]) == int(logits[1, :V].argmax())


def test_new_masks_and_parameters_compile_nothing() -> None:
    rng = np.random.default_rng(2)
    sampler = _sampler(True)
    compact, dest = _random_masks(rng)
    _step(sampler, torch.randn(N, L), compact, dest)  # compiles the graph
    before = compile_stats()
    for i in range(4):
        compact, _ = _random_masks(rng)
        dest = np.roll(np.array([N, N, 1, 3]), i)  # different constrained rows each step
        _step(sampler, torch.randn(N, L), compact, dest)
    assert (compile_stats() - before).compilations == 0
