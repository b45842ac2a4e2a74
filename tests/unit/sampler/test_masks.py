"""Packed bitmask handling: unpacking, wire bytes, the reorder (scatter) step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_worker.masks import (
    mask_dest_index,
    scatter_mask_rows,
    unpack_mask,
    words_per_row,
)


def reference_unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bit i of word j is column 32*j + i, one Python bit test at a time."""
    out = torch.zeros(packed.shape[0], width, dtype=torch.bool)
    for r, row in enumerate(packed.tolist()):
        for col in range(width):
            out[r, col] = bool((row[col // 32] & 0xFFFFFFFF) >> (col % 32) & 1)
    return out


@pytest.mark.parametrize("bit", [0, 1, 5, 30, 31])
@pytest.mark.parametrize("word", [0, 3])
def test_single_set_bit(device: torch.device, word: int, bit: int) -> None:
    packed = torch.zeros(1, 4, dtype=torch.int32)
    packed[0, word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)  # bit 31: sign
    mask = unpack_mask(packed.to(device), 128).cpu()
    assert mask.sum().item() == 1
    assert mask[0, 32 * word + bit]


@pytest.mark.parametrize("vocab", [128_256, 49_152, 1_000, 33])
def test_all_ones_and_all_zeros(device: torch.device, vocab: int) -> None:
    w = words_per_row(vocab)
    ones = unpack_mask(torch.full((2, w), -1, dtype=torch.int32, device=device), vocab)
    zeros = unpack_mask(torch.zeros(2, w, dtype=torch.int32, device=device), vocab)
    assert ones.shape == zeros.shape == (2, vocab)
    assert ones.all() and not zeros.any()


def test_alternating_bits(device: torch.device) -> None:
    packed = torch.full((2, 3), 0x55555555, dtype=torch.int32, device=device)
    mask = unpack_mask(packed, 96).cpu()
    assert torch.equal(mask[0], torch.arange(96) % 2 == 0)
    inverted = unpack_mask(~packed, 96).cpu()
    assert torch.equal(inverted[1], torch.arange(96) % 2 == 1)


@pytest.mark.parametrize("vocab", [128_256, 49_152, 50_001])
def test_random_rows_match_bit_by_bit(device: torch.device, vocab: int) -> None:
    w = words_per_row(vocab)
    assert w == -(-vocab // 32)
    g = torch.Generator().manual_seed(vocab)
    packed = torch.randint(-(2**31), 2**31, (3, w), generator=g, dtype=torch.int64).to(torch.int32)
    got = unpack_mask(packed.to(device), vocab).cpu()
    cols = torch.tensor(sorted({0, 31, 32, vocab // 2, vocab - 33, vocab - 1}))
    want = reference_unpack(packed[:, :w], vocab)[:, cols]
    assert torch.equal(got[:, cols], want)
    # Whole rows through numpy's own bit order (little-endian bits of little-endian words).
    bits = np.unpackbits(packed.numpy().astype("<i4").view(np.uint8), bitorder="little")
    assert torch.equal(got, torch.from_numpy(bits.reshape(3, 32 * w)[:, :vocab].astype(bool)))


def test_dest_index_with_drafts_and_unconstrained() -> None:
    # Service order: A (constrained, 2 accepted drafts, batch rows 4..6), B unconstrained (row 0),
    # C constrained (row 1), D constrained but not sampled this step (dropped).
    dest = mask_dest_index([4, 0, 1, None], [3, 0, 1, 1], n_rows=8, size=6)
    assert dest.dtype == torch.int64
    assert dest.tolist() == [4, 5, 6, 1, 8, 8]


@pytest.mark.parametrize(
    ("rows", "counts", "why"),
    [
        ([0, 1], [1], "mask_rows entries"),
        ([7], [2], "outside"),
        ([-1], [1], "outside"),
        ([0, 1], [2, 1], "two mask rows"),
        ([0, 2, 4], [2, 2, 2], "more than"),
    ],
)
def test_dest_index_rejects_bad_layouts(rows: list[int], counts: list[int], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        mask_dest_index(rows, counts, n_rows=8, size=5)


def test_scatter_places_rows_and_fills_ones(device: torch.device) -> None:
    compact = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 9]], dtype=torch.int32)
    dest = mask_dest_index([2, None, 0], [2, 1, 1], n_rows=4, size=5)
    out = scatter_mask_rows(compact.to(device), dest.to(device), 4).cpu()
    assert out.tolist() == [[7, 8], [-1, -1], [1, 2], [3, 4]]


def test_scatter_compiles_without_graph_breaks() -> None:
    fn = torch.compile(scatter_mask_rows, fullgraph=True, dynamic=False)
    compact = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    dest = torch.tensor([3, 0, 5, 5])
    assert fn(compact, dest, 5).tolist() == scatter_mask_rows(compact, dest, 5).tolist()
