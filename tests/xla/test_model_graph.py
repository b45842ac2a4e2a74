"""The decoder on the XLA device: same logits as on CPU, one graph per (B, T, kv_len) bucket, no
recompilation across decode steps (the cache update is part of the step's graph)."""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

from neuron_worker.model import build_model
from neuron_worker.xla import compile_stats
from tests.unit.model.tiny import TINY, random_weights

pytestmark = pytest.mark.xla


@torch.no_grad()
def test_prefill_and_decode_match_cpu_without_recompiles() -> None:
    device = torch_xla.device()
    cpu = build_model(TINY, random_weights(TINY))
    xla = build_model(TINY, random_weights(TINY), device=device)
    cpu.setup_caches(4, 64)
    xla.setup_caches(4, 64)
    slots = torch.tensor([2, 0])

    def both(tokens: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        expected = cpu.logits(cpu(tokens, pos, slots, 16).flatten(0, 1))
        got = xla.logits(xla(tokens.to(device), pos.to(device), slots.to(device), 16).flatten(0, 1))
        xm.mark_step()
        return got.cpu(), expected

    # Prefill with a padded row, then decode steps at growing positions.
    got, expected = both(
        torch.tensor([[5, 17, 3, 88], [11, 70, 0, 0]]), torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]])
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    compiled = []
    for step in range(6):
        got, expected = both(
            torch.tensor([[7 + step], [9 + step]]), torch.tensor([[4 + step], [2 + step]])
        )
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        compiled.append(compile_stats().compilations)
    assert compiled[1:] == [compiled[0]] * 5, f"decode recompiled: {compiled}"
