"""Packed token bitmasks on the worker: wire bytes -> compact rows -> batch layout -> bool mask.

Format (DESIGN.md, "Bitmask format"): one row of ``W = ceil(V / 32)`` int32 words per constrained
sampling position; bit ``i`` of word ``j`` allows token ``32 * j + i``; all ones (``-1``) means
unconstrained. The grammar service returns the rows of constrained requests only, concatenated in
its own row order (a request's draft rows follow its main row). The worker keeps them packed up to
the device (8x smaller than a bool mask) and unpacks them there.

Wire bytes are decoded by :func:`maskwire.bitmask.step_masks` (shared with the grammar service's
tests and benchmark). Host side here: :func:`mask_dest_index`. Device side (pure, static-shape,
traceable by ``torch.compile`` and torch_xla): :func:`scatter_mask_rows` and :func:`unpack_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from maskwire.bitmask import words_per_row

__all__ = [
    "mask_dest_index",
    "scatter_mask_rows",
    "unpack_mask",
    "words_per_row",
]


def mask_dest_index(
    rows: Sequence[int | None],
    mask_rows: Sequence[int],
    *,
    n_rows: int,
    size: int,
) -> Tensor:
    """Host side of the reorder step: where each compact mask row goes in the sampling batch.

    ``rows[i]`` and ``mask_rows[i]`` describe the i-th entry of the grammar service's
    ``StepResult.rows`` (the order of the compact rows): ``rows[i]`` is the batch row of that
    request's main sampling position (``None``: the request is not sampled this step; its rows are
    dropped), ``mask_rows[i]`` is ``RowResult.mask_rows`` (0 for an unconstrained request,
    ``1 + accepted_drafts`` otherwise). The k-th compact row of entry i goes to batch row
    ``rows[i] + k``: draft rows follow the main row in the batch layout, as on the wire. Batch rows
    of rejected drafts get no mask row (they stay all ones; their samples are discarded anyway).

    Returns int64 ``[size]`` on the CPU (``size`` is the static compact row count, padded with
    ``n_rows`` = "drop"). Raises ``ValueError`` for an inconsistent layout: more rows than ``size``,
    a destination outside ``[0, n_rows)`` or two rows sent to the same batch row.
    """
    if len(rows) != len(mask_rows):
        raise ValueError(f"{len(rows)} rows but {len(mask_rows)} mask_rows entries")
    dest = np.full(size, n_rows, dtype=np.int64)
    used = np.zeros(n_rows, dtype=bool)
    m = 0
    for row, count in zip(rows, mask_rows, strict=True):
        if count < 0:
            raise ValueError(f"negative mask row count {count}")
        if m + count > size:
            raise ValueError(f"more than {size} compact mask rows")
        if row is not None and count:
            if row < 0 or row + count > n_rows:
                raise ValueError(f"mask rows [{row}, {row + count}) outside the batch of {n_rows}")
            if used[row : row + count].any():
                raise ValueError(f"two mask rows for batch rows [{row}, {row + count})")
            used[row : row + count] = True
            dest[m : m + count] = np.arange(row, row + count)
        m += count
    return torch.from_numpy(dest)


def scatter_mask_rows(compact: Tensor, dest: Tensor, n_rows: int) -> Tensor:
    """The reorder step: compact mask rows -> batch order.

    ``compact``: int32 ``[M, W]`` rows as the grammar service returned them, padded to a static
    ``M`` with junk rows; ``dest``: int64 ``[M]``, the batch row of each compact row or ``n_rows``
    for junk. Returns int32 ``[n_rows, W]``: the rows placed, every other row all ones (``-1``).
    Pure and static-shape (junk lands in a spare row that is sliced off), so it runs under
    ``torch.compile`` and torch_xla alike.
    """
    out = torch.full((n_rows + 1, compact.shape[1]), -1, dtype=torch.int32, device=compact.device)
    out = out.index_copy(0, dest, compact)
    return out[:n_rows]


def unpack_mask(packed: Tensor, width: int) -> Tensor:
    """int32 ``[N, W]`` packed rows -> bool ``[N, width]`` (``width <= 32 * W``): bit i of word j
    is column ``32 * j + i``. Columns past ``width`` (padding bits of the last word) are dropped."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    # Not `>>`: torch_xla 2.9 lowers that operator on negative ints as a truncating division (bit
    # 31 set = negative word); bitwise_right_shift is an arithmetic shift on every backend.
    unpacked = torch.bitwise_right_shift(packed.unsqueeze(-1), bits) & 1
    return unpacked.reshape(packed.shape[0], packed.shape[1] * 32)[:, :width].bool()
