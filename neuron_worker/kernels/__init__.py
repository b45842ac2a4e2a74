"""The worker's own CPU kernels (bf16), compiled from C++ at first use and cached on disk.

* `int4_matmul.cpp`: 4-bit weights times bf16 activations for decode passes of up to 8 rows in
  one read of the weights.
* `decode_attention.cpp`: attention for passes of one token per row, reading each row's KV cache
  slot in place.

Each file's header says how. Both split their work over torch's intra-op threads
(`at::parallel_for`, which is serial unless the library is built with `-fopenmp`; it then shares
the OpenMP runtime torch has loaded). They need a C++ compiler (inductor already does) and a CPU
with AVX512-BF16; where either is missing, or `MASKWIRE_KERNELS=0` is set, `available()` is False
(the reason logged once) and the worker uses aten's int4 kernel and SDPA instead.

The shared object is built into `<compile cache>/kernels/` (`set_kernel_dir`, which the worker
calls with its `--compile-cache`), named by a hash of the sources, the torch version and the
compiler flags, so a restart loads it in milliseconds and an upgrade rebuilds it (~10 s).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from neuron_worker.tuning import default_compile_cache

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("int4_matmul.cpp", "decode_attention.cpp"))
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",  # torch's headers warn under -std=c++17 with newer torch; the kernel itself is clean
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mfma",
    "-fopenmp",  # without it `at::parallel_for` compiles to a serial loop
)
BLOCK, GROUP = 16, 32
DISABLE_ENV = "MASKWIRE_KERNELS"

_lock = threading.Lock()
_kernel_dir: Path | None = None
_state: bool | None = None  # None: not tried yet


def set_kernel_dir(path: Path | None) -> None:
    """Where to build and find the kernels (`None`: under the default compile cache)."""
    global _kernel_dir
    _kernel_dir = path


def available() -> bool:
    """Whether the kernels are usable here: built (or found) and loaded on the first call."""
    global _state
    with _lock:
        if _state is None:
            reason = _unavailable_reason()
            if reason is None:
                try:
                    torch.ops.load_library(str(_build_somewhere()))
                    _register_fake()
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    reason = f"could not build them: {exc}"
            if reason is not None:
                log.warning(
                    "maskwire kernels unavailable (%s); using aten's int4 kernel and SDPA", reason
                )
            _state = reason is None
        return _state


def _build_somewhere() -> Path:
    """Build into the kernel directory, or into a temporary one where that is not writable (a
    read-only cache volume): the kernels then cost a build at every start, not the speed."""
    directory = _kernel_dir or default_compile_cache() / "kernels"
    try:
        return build(directory)
    except PermissionError as exc:
        log.warning(
            "kernel directory %s not writable (%s); building in a temporary one", directory, exc
        )
        return build(Path(tempfile.mkdtemp(prefix="maskwire-kernels-")))


def _unavailable_reason() -> str | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    if sys.platform != "linux":
        return "not Linux"
    try:
        flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError as exc:
        return f"cannot read the CPU flags: {exc}"
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if compiler() is None:
        return "no C++ compiler (set CXX)"
    return None


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(directory: Path) -> Path:
    """Compile the kernels into `directory` unless they are there already; returns the .so path.

    Concurrent builders (tensor-parallel ranks, test workers) each compile into a private file
    and rename it into place, so a reader never loads a half-written library."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    key = hashlib.sha256(
        "\n".join([*(s.read_text() for s in SOURCES), torch.__version__, cxx, *flags]).encode()
    ).hexdigest()[:16]
    target = directory / f"maskwire_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        sources = [str(s) for s in SOURCES]
        cmd = [cxx, *flags, *includes, *sources, *libs, "-lc10", "-ltorch_cpu", "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the maskwire kernels: %s", target)
    return target


def _register_fake() -> None:
    @torch.library.register_fake("maskwire_kernels::int4_matmul")
    def _matmul_shape(x: Tensor, w: Tensor, scale_zero: Tensor) -> Tensor:
        return x.new_empty(x.shape[0], w.shape[0] * BLOCK)

    @torch.library.register_fake("maskwire_kernels::decode_attention")
    def _attention_shape(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, pos: Tensor) -> Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight's shape fits the kernel's blocks (16 outputs, 32 inputs)."""
    return out_features % BLOCK == 0 and in_features % GROUP == 0


def pack_int4(q: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
    """A Q4_1 weight (q uint8 [N, K] in 0..15; scale, low [N, K/32]; w = scale * q + low) in the
    kernel's layout (`int4_matmul.cpp`): packed nibbles [N/16, K/32, 8, 32] and fp32 scales and
    zeros [N/16, K/32, 2, 16] for w = scale * (q - 8) + zero."""
    n, k = q.shape
    if not fits(n, k):
        raise ValueError(f"a [{n}, {k}] weight does not fit blocks of {BLOCK} x {GROUP}")
    # [block, channel, group, chunk, nibble half, input] -> [block, group, chunk, half, ch, input]
    chunks = q.reshape(n // BLOCK, BLOCK, k // GROUP, GROUP // 4, 2, 2).permute(0, 2, 3, 4, 1, 5)
    packed = (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).reshape(n // BLOCK, k // GROUP, 8, 32)
    zero = low.float() + 8 * scale.float()
    per_group = torch.stack([scale.float(), zero])  # [2, N, K/32]
    scale_zero = per_group.reshape(2, n // BLOCK, BLOCK, k // GROUP).permute(1, 3, 0, 2)
    return packed.contiguous(), scale_zero.contiguous()


def int4_matmul(x: Tensor, packed: Tensor, scale_zero: Tensor) -> Tensor:
    """`x @ W^T` for bf16 x [rows, K] and a `pack_int4` weight; bf16 [rows, N]."""
    return torch.ops.maskwire_kernels.int4_matmul(x, packed, scale_zero)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, pos: Tensor) -> Tensor:
    """Softmax attention of q (bf16 [B, H, R, D]; query row r is token r % T) over the cache
    slots `slots` [B] of k, v ([slots, H, L, D] views): query (b, r) attends positions 0..pos[b,
    r % T] (pos [B, T]; clamped to 0..L-1). Scale 1/sqrt(D), as SDPA's default."""
    return torch.ops.maskwire_kernels.decode_attention(q, k, v, slots, pos)
