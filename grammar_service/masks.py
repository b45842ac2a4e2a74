"""The step's mask rows: one preallocated int32 buffer, filled in one batched call.

Row layout is the wire format (DESIGN.md): `W = ceil(V / 32)` little-endian int32 words per row,
bit `i` of word `j` = token `32*j + i`. llguidance's own padded row is longer (it rounds up and
adds a word); we hand it `one_mask_bytes = W * 4` and it writes exactly that.
"""

from __future__ import annotations

import sys

import numpy as np

assert sys.byteorder == "little", "masks are sent as the host's int32 words: little-endian only"


class MaskBuffer:
    """A reusable `[capacity, W]` int32 buffer that grows (doubling) when a step needs more rows."""

    def __init__(self, words_per_row: int, capacity: int = 64) -> None:
        self.words_per_row = words_per_row
        self.one_mask_bytes = words_per_row * 4
        self._array = np.zeros((max(1, capacity), words_per_row), dtype=np.int32)
        self.ptr = int(self._array.ctypes.data)  # cached: `.ctypes.data` costs µs per call

    @property
    def capacity(self) -> int:
        return int(self._array.shape[0])

    def reserve(self, n_rows: int) -> None:
        if n_rows > self.capacity:
            cap = self.capacity
            while cap < n_rows:
                cap *= 2
            self._array = np.zeros((cap, self.words_per_row), dtype=np.int32)
            self.ptr = int(self._array.ctypes.data)

    def rows(self, n_rows: int) -> np.ndarray:
        return self._array[:n_rows]

    def tobytes(self, n_rows: int) -> bytes:
        """The first `n_rows` rows as wire bytes (one copy)."""
        return self._array[:n_rows].tobytes()
