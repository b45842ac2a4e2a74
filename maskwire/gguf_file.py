"""A fast reader for GGUF files: metadata as Python values, tensors as memory-mapped numpy arrays.

`gguf.GGUFReader` builds a numpy view per metadata item; on a 49k-token vocabulary that takes ~5 s.
This reader parses the same header with `struct` in ~0.1 s and dequantizes the types the
embedded model stores (F32, F16, Q4_1, Q8_0) itself, leaving the others to
`gguf.quants.dequantize` (importing `gguf` takes ~0.4 s; its Q4_1 path ~1 s for SmolLM2-135M).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8  # ggml type ids
# (elements per block, bytes per block) of the types read without `gguf`.
_BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_1: (32, 20), Q8_0: (32, 34)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    ggml_type: int
    data: np.ndarray  # uint8 [*shape[:-1], bytes per row], memory-mapped

    def dequantize(self) -> np.ndarray:
        """fp32 values of the given shape (a copy)."""
        if self.ggml_type == F32:
            return self.data.copy().view(np.float32).reshape(self.shape)
        if self.ggml_type == F16:
            return self.data.copy().view(np.float16).astype(np.float32).reshape(self.shape)
        if (q4 := self.q4_1_blocks()) is not None:
            return _blockwise(q4[0], q4[1], q4[2]).reshape(self.shape)
        if (q8 := self.q8_0_blocks()) is not None:
            return _blockwise(q8[0], q8[1], None).reshape(self.shape)
        import gguf

        qtype = gguf.GGMLQuantizationType(self.ggml_type)
        out = np.asarray(gguf.quants.dequantize(self.data, qtype), dtype=np.float32)
        return out.reshape(self.shape).copy()

    def q4_1_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A Q4_1 tensor's own numbers, `w = scale * q + min` per block of 32 along a row:
        (q uint8 [rows, cols] in 0..15, scale float32 [rows, cols/32], min float32 [rows,
        cols/32]); None for other types. What `dequantize` computes, before it computes it."""
        if self.ggml_type != Q4_1 or len(self.shape) != 2:
            return None
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // 32, 20)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:20]
        # ggml packs element j in the low nibble and element j + 16 in the high one.
        q = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)
        return q, scale, low

    def q8_0_blocks(self) -> tuple[np.ndarray, np.ndarray] | None:
        """A Q8_0 tensor's own numbers, `w = scale * q` per block of 32 along a row: (q int8
        [rows, cols], scale float32 [rows, cols/32]); None for other types."""
        if self.ggml_type != Q8_0 or len(self.shape) != 2:
            return None
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // 32, 34)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
        return q, scale


def _blockwise(q: np.ndarray, scale: np.ndarray, low: np.ndarray | None) -> np.ndarray:
    """`scale * q (+ low)` per block of 32 along the last axis, in fp32."""
    rows, cols = q.shape
    out = q.reshape(rows, cols // 32, 32).astype(np.float32)
    out *= scale[..., None]
    if low is not None:
        out += low[..., None]
    return out.reshape(rows, cols)


class GGUFFile:
    """Parsed GGUF header. `metadata` maps keys to values (arrays as lists); `tensors` by name."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        self._off = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), int(ggml_type), int(offset)))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._off // align) * align
        raw = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, ggml_type, offset in infos:
            block, type_size = _block_size(ggml_type)
            row_bytes = shape[-1] // block * type_size
            n_rows = int(np.prod(shape[:-1], dtype=np.int64))
            start = data_start + offset
            data = raw[start : start + n_rows * row_bytes].reshape(*shape[:-1], row_bytes)
            self.tensors[name] = GGUFTensor(name, shape, ggml_type, data)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._mm, self._off)
        self._off += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = bytes(self._mm[self._off : self._off + n]).decode("utf-8", errors="replace")
        self._off += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._unpack("<IQ")
            if itype in _SCALARS:
                fmt = _SCALARS[itype]
                return list(self._unpack(f"<{count}{fmt[1]}"))
            return [self._value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._unpack(_SCALARS[vtype])[0]


def _block_size(ggml_type: int) -> tuple[int, int]:
    if ggml_type in _BLOCKS:
        return _BLOCKS[ggml_type]
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return int(block), int(type_size)
