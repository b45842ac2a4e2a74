"""The worker's own CPU kernels, compiled from C++ at first use and cached on disk.

* `matmul_bf16.cpp` (AVX512-BF16, AVX512-VNNI): 4- and 8-bit weights (llama.cpp's Q4_1 and Q8_0
  blocks) times bf16 activations for decode passes of up to 8 rows in one read of the weights,
  and the 4-bit weights times 8-bit activations (`int4_matmul_q8`, VNNI integer dot products).
* `decode_attention.cpp` (AVX512-BF16): attention for passes of one token per row, reading each
  row's KV cache slot in place.
* `decode_step.cpp` (AVX512-BF16): a whole pass of one token per row in one call, through the
  kernels above (`neuron_worker.model.fused_decode`); `decode_step.h` holds what it shares with
  `decode_step_f32.cpp` (below), `vector_math.h` the exp the kernels share.
* `matmul_f32.cpp` (AVX2 + FMA): 4- and 8-bit weights (llama.cpp's Q4_1 and Q8_0 blocks) times
  fp32 activations, the same idea for CPUs where bf16 is emulated and the worker runs fp32; and
  the 4-bit weights times 8-bit activations (`int4_matmul_q8_f32`, integer products).
* `decode_attention_f32.cpp` (AVX2 + FMA): the decode attention for fp32 caches.
* `decode_step_f32.cpp` (AVX2 + FMA): the whole decode pass for fp32 models.
* `greedy_tokens.cpp` (AVX2): a greedy step's sampling in one call (grammar mask rows, EOS ban,
  first largest allowed logit), the sampler's greedy graph without its small ops
  (`neuron_worker.greedy_kernel`).

Each file's header says how; `decode_attention.h` holds what the two attention files share (input
checks, the positions each query attends, the split into tasks), `matmul.h` what the two matmul
files share (passes of up to 8 rows, output channel blocks over the threads). The library holds the
files the CPU can run (`KERNEL_SETS`: all seven on AVX512-BF16, the three fp32 ones and the greedy
one on AVX2). They
split their work over torch's intra-op threads (`at::parallel_for`, which is serial unless the
library is built with `-fopenmp`; it then shares the OpenMP runtime torch has loaded). They need a
C++ compiler (inductor already does); where it or the CPU features are missing, or
`MASKWIRE_KERNELS=0` is set, `available()` is False (the reason logged once) and the worker uses
aten's int4 kernel and SDPA instead. `MASKWIRE_KERNELS=<set name>` (`avx2`) loads that set where the
CPU runs it instead of the richest one: the AVX2 host's code path on an AVX-512 host, for tests and
benchmarks.

The shared object is built into `<compile cache>/kernels/` (`compile_cache.kernel_directory`:
under the worker's `--compile-cache`), named by a hash of the sources (headers included), the torch
version and the compiler flags, so a restart loads it in milliseconds and an upgrade rebuilds it
(~10 s).
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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from maskwire.cpus import cpu_model_and_flags
from neuron_worker.compile_cache import kernel_directory

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class KernelSet:
    """The sources one kind of CPU runs, and the flags they need (from /proc/cpuinfo, for g++)."""

    name: str
    cpu_flags: tuple[str, ...]
    sources: tuple[Path, ...]
    isa_flags: tuple[str, ...]
    bf16: bool  # the bf16 kernels (int4_matmul, int8_matmul, decode_attention) are in it


AVX2_SOURCES = (
    _HERE / "matmul_f32.cpp",
    _HERE / "decode_attention_f32.cpp",
    _HERE / "decode_step_f32.cpp",
    _HERE / "greedy_tokens.cpp",
)
KERNEL_SETS = (
    KernelSet(
        "avx512-bf16",
        ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
        (
            _HERE / "matmul_bf16.cpp",
            _HERE / "decode_attention.cpp",
            _HERE / "decode_step.cpp",
            *AVX2_SOURCES,
        ),
        (
            "-mavx2",
            "-mfma",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
            "-mavx512vnni",
        ),
        bf16=True,
    ),
    KernelSet("avx2", ("avx2", "fma"), AVX2_SOURCES, ("-mavx2", "-mfma"), False),
)
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",  # torch's headers warn under -std=c++17 with newer torch; the kernels themselves are clean
    "-fopenmp",  # without it `at::parallel_for` compiles to a serial loop
)
BLOCK, GROUP = 16, 32
BLOCK_F32 = 8
KERNELS_ENV = "MASKWIRE_KERNELS"  # 0: none; a set name: that set; unset: the richest

_lock = threading.Lock()
_loaded: KernelSet | None = None
_tried = False


def available() -> bool:
    """Whether the kernels are usable here: built (or found) and loaded on the first call."""
    return _load() is not None


def bf16_available() -> bool:
    """Whether the bf16 kernels (`int4_matmul`, `int8_matmul`, `decode_attention`) are loaded
    (AVX512-BF16)."""
    loaded = _load()
    return loaded is not None and loaded.bf16


def attention_available(dtype: torch.dtype) -> bool:
    """Whether `decode_attention` runs caches of `dtype` here (fp32: AVX2; bf16: AVX512-BF16)."""
    loaded = _load()
    if loaded is None:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and loaded.bf16)


def _load() -> KernelSet | None:
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            chosen, reason = _choose()
            if chosen is not None:
                try:
                    torch.ops.load_library(str(_build_somewhere(chosen)))
                    _register_fake(chosen)
                    _loaded = chosen
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    reason = f"could not build them: {exc}"
            if _loaded is None:
                log.warning(
                    "maskwire kernels unavailable (%s); using aten's int4 kernel and SDPA", reason
                )
        return _loaded


def _build_somewhere(kernel_set: KernelSet) -> Path:
    """Build into the kernel directory, or into a temporary one where that is not writable (a
    read-only cache volume): the kernels then cost a build at every start, not the speed."""
    directory = kernel_directory()
    try:
        return build(directory, kernel_set)
    except PermissionError as exc:
        log.warning(
            "kernel directory %s not writable (%s); building in a temporary one", directory, exc
        )
        return build(Path(tempfile.mkdtemp(prefix="maskwire-kernels-")), kernel_set)


def cpu_kernel_set() -> KernelSet | None:
    """The kernel set for this CPU (from its flags; nothing is built): the richest it runs, or
    the one `MASKWIRE_KERNELS` names."""
    return _choose()[0]


def _choose() -> tuple[KernelSet | None, str]:
    """The kernel set to build here, or None and why not."""
    wanted = os.environ.get(KERNELS_ENV, "")
    if wanted == "0":
        return None, f"{KERNELS_ENV}=0"
    if sys.platform != "linux":
        return None, "not Linux"
    _, flags = cpu_model_and_flags()
    if not flags:
        return None, "cannot read the CPU flags (/proc/cpuinfo)"
    runnable = [s for s in KERNEL_SETS if all(f in flags for f in s.cpu_flags)]
    if not runnable:
        return (
            None,
            f"the CPU lacks {', '.join(f for f in KERNEL_SETS[-1].cpu_flags if f not in flags)}",
        )
    if wanted not in ("", "1"):
        named = [s for s in runnable if s.name == wanted]
        if not named:
            sets = ", ".join(s.name for s in KERNEL_SETS)
            return None, f"{KERNELS_ENV}={wanted}: not a kernel set this CPU runs ({sets})"
        runnable = named
    if compiler() is None:
        return None, "no C++ compiler (set CXX)"
    return runnable[0], ""


def sources_digest() -> str:
    """A hash of every kernel source and header: what the kernels compute, for keys of what was
    measured with them (`neuron_worker.kernel_choice`)."""
    h = hashlib.sha256()
    for path in sorted((*_HERE.glob("*.cpp"), *_HERE.glob("*.h"))):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(directory: Path, kernel_set: KernelSet = KERNEL_SETS[0]) -> Path:
    """Compile `kernel_set` into `directory` unless it is there already; returns the .so path.

    Concurrent builders (tensor-parallel ranks, test workers) each compile into a private file
    and rename it into place, so a reader never loads a half-written library."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*CXX_FLAGS, *kernel_set.isa_flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    sources = [str(s) for s in kernel_set.sources]
    texts = [s.read_text() for s in (*kernel_set.sources, *sorted(_HERE.glob("*.h")))]
    # By the files' names and texts, not their paths: checkouts of the same sources share a build.
    names = [s.name for s in kernel_set.sources]
    key = hashlib.sha256(
        "\n".join([*texts, *names, torch.__version__, cxx, *flags]).encode()
    ).hexdigest()[:16]
    target = directory / f"maskwire_kernels-{kernel_set.name}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        cmd = [cxx, *flags, *includes, *sources, *libs, "-lc10", "-ltorch_cpu", "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the maskwire kernels (%s): %s", kernel_set.name, target)
    return target


def _register_fake(kernel_set: KernelSet) -> None:
    for op in ("int4_matmul_f32", "int8_matmul_f32", "int4_matmul_q8_f32"):

        @torch.library.register_fake(f"maskwire_kernels::{op}")
        def _matmul_f32_shape(x: Tensor, w: Tensor, params: Tensor) -> Tensor:
            return x.new_empty(x.shape[0], w.shape[0] * BLOCK_F32)

    attentions = ["decode_attention_f32"]
    if kernel_set.bf16:
        attentions.append("decode_attention")

        for op in ("int4_matmul", "int8_matmul", "int4_matmul_q8"):

            @torch.library.register_fake(f"maskwire_kernels::{op}")
            def _matmul_shape(x: Tensor, w: Tensor, params: Tensor) -> Tensor:
                return x.new_empty(x.shape[0], w.shape[0] * BLOCK)

    for op in attentions:

        @torch.library.register_fake(f"maskwire_kernels::{op}")
        def _attention_shape(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, pos: Tensor) -> Tensor:
            return torch.empty_like(q, memory_format=torch.contiguous_format)


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight's shape fits the kernel's blocks (16 outputs, 32 inputs)."""
    return out_features % BLOCK == 0 and in_features % GROUP == 0


def _exact_params(*params: Tensor) -> Tensor:
    """`params` stacked [len, ...] as fp16 where every value is one exactly (a GGUF checkpoint's
    are: it stores them so), else as fp32: the bf16 kernels read either, and at one row, where
    the weights stream from memory, fp16 parameters are a sixth less to read (Q4_1)."""
    stacked = torch.stack([p.float() for p in params])
    half = stacked.half()
    return half if torch.equal(half.float(), stacked) else stacked


def pack_int4(q: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
    """A Q4_1 weight (q uint8 [N, K] in 0..15; scale, low [N, K/32]; w = scale * q + low) in the
    kernel's layout (`matmul_bf16.cpp`): packed nibbles [N/16, K/32, 8, 32] and the scales and
    minimums [N/16, K/32, 2, 16], fp16 where exact (`_exact_params`), else fp32."""
    n, k = q.shape
    if not fits(n, k):
        raise ValueError(f"a [{n}, {k}] weight does not fit blocks of {BLOCK} x {GROUP}")
    # [block, channel, group, chunk, nibble half, input] -> [block, group, chunk, half, ch, input]
    chunks = q.reshape(n // BLOCK, BLOCK, k // GROUP, GROUP // 4, 2, 2).permute(0, 2, 3, 4, 1, 5)
    packed = (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).reshape(n // BLOCK, k // GROUP, 8, 32)
    per_group = _exact_params(scale, low)  # [2, N, K/32]
    scale_low = per_group.reshape(2, n // BLOCK, BLOCK, k // GROUP).permute(1, 3, 0, 2)
    return packed.contiguous(), scale_low.contiguous()


def pack_int8(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """A Q8_0 weight (q int8 [N, K]; scale [N, K/32]; w = scale * q) in `matmul_bf16.cpp`'s
    layout: int8 [N/16, K/32, 16, 32] (chunk j: 16 channels x inputs 2j, 2j + 1) and scales
    [N/16, K/32, 16], fp16 where exact (`_exact_params`), else fp32."""
    n, k = q.shape
    if not fits(n, k):
        raise ValueError(f"a [{n}, {k}] weight does not fit blocks of {BLOCK} x {GROUP}")
    # [block, channel, group, chunk, input] -> [block, group, chunk, channel, input]
    chunks = q.reshape(n // BLOCK, BLOCK, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    packed = chunks.reshape(n // BLOCK, k // GROUP, GROUP // 2, 2 * BLOCK)
    scales = _exact_params(scale)[0].reshape(n // BLOCK, BLOCK, k // GROUP).permute(0, 2, 1)
    return packed.contiguous(), scales.contiguous()


def pack_int4_f32(q: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
    """A Q4_1 weight (as `pack_int4` takes it) in `matmul_f32.cpp`'s layout: packed nibbles
    [N/8, K/32, 16, 8] and fp32 scales and minimums [N/8, K/32, 2, 8]."""
    n, k = q.shape
    if n % BLOCK_F32 or k % GROUP:
        raise ValueError(f"a [{n}, {k}] weight does not fit blocks of {BLOCK_F32} x {GROUP}")
    # [block, channel, group, half, input] -> [block, group, half, input, channel]
    halves = q.reshape(n // BLOCK_F32, BLOCK_F32, k // GROUP, 2, GROUP // 2).permute(0, 2, 3, 4, 1)
    packed = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [block, group, input j, channel]
    per_group = torch.stack([scale.float(), low.float()])  # [2, N, K/32]
    scale_low = per_group.reshape(2, n // BLOCK_F32, BLOCK_F32, k // GROUP).permute(1, 3, 0, 2)
    return packed.contiguous(), scale_low.contiguous()


def pack_int8_f32(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """A Q8_0 weight (q int8 [N, K]; scale [N, K/32]; w = scale * q) in `matmul_f32.cpp`'s
    layout: int8 [N/8, K/32, 32, 8] and fp32 scales [N/8, K/32, 1, 8]."""
    n, k = q.shape
    if n % BLOCK_F32 or k % GROUP:
        raise ValueError(f"a [{n}, {k}] weight does not fit blocks of {BLOCK_F32} x {GROUP}")
    # [block, channel, group, input] -> [block, group, input, channel]
    packed = q.reshape(n // BLOCK_F32, BLOCK_F32, k // GROUP, GROUP).permute(0, 2, 3, 1)
    scales = scale.float().reshape(n // BLOCK_F32, BLOCK_F32, k // GROUP, 1).permute(0, 2, 3, 1)
    return packed.contiguous(), scales.contiguous()


def pack_int4_q8_f32(q: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
    """A Q4_1 weight (as `pack_int4` takes it) in the layout of `matmul_f32.cpp`'s 8-bit-activation
    kernel: packed nibbles [N/8, K/32, 4, 32] (byte 4c + e of chunk t: channel c's inputs 8t + e
    and 8t + 4 + e) and fp32 scales and zeros [N/8, K/32, 2, 8] for w = scale * (q - 8) + zero."""
    n, k = q.shape
    if n % BLOCK_F32 or k % GROUP:
        raise ValueError(f"a [{n}, {k}] weight does not fit blocks of {BLOCK_F32} x {GROUP}")
    # [block, channel, group, chunk, half, input] -> [block, group, chunk, half, channel, input]
    halves = q.reshape(n // BLOCK_F32, BLOCK_F32, k // GROUP, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    packed = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).reshape(
        n // BLOCK_F32, k // GROUP, 4, 32
    )
    per_group = torch.stack([scale.float(), low.float() + 8 * scale.float()])  # [2, N, K/32]
    scale_zero = per_group.reshape(2, n // BLOCK_F32, BLOCK_F32, k // GROUP).permute(1, 3, 0, 2)
    return packed.contiguous(), scale_zero.contiguous()


def int4_matmul(x: Tensor, packed: Tensor, scale_low: Tensor) -> Tensor:
    """`x @ W^T` for bf16 x [rows, K] and a `pack_int4` weight; bf16 [rows, N]."""
    return torch.ops.maskwire_kernels.int4_matmul(x, packed, scale_low)


def set_weight_prefetch(groups: int) -> int:
    """How many groups of 32 inputs ahead the bf16 matmuls (`int4_matmul`, `int8_matmul`)
    prefetch their weights (0: none; the default 8); returns the distance before. A negative
    `groups` only reads it. The results are the same at any distance."""
    return int(torch.ops.maskwire_kernels.set_weight_prefetch(groups))


def int4_matmul_q8(x: Tensor, packed: Tensor, scale_low: Tensor) -> Tensor:
    """`int4_matmul`'s weights times 8-bit activations (each row's inputs quantized per group of
    32, llama.cpp's Q8): bf16 [rows, K] -> bf16 [rows, N]."""
    return torch.ops.maskwire_kernels.int4_matmul_q8(x, packed, scale_low)


def int8_matmul(x: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """`x @ W^T` for bf16 x [rows, K] and a `pack_int8` weight; bf16 [rows, N]."""
    return torch.ops.maskwire_kernels.int8_matmul(x, packed, scale)


def int4_matmul_f32(x: Tensor, packed: Tensor, scale_low: Tensor) -> Tensor:
    """`x @ W^T` for fp32 x [rows, K] and a `pack_int4_f32` weight; fp32 [rows, N]."""
    return torch.ops.maskwire_kernels.int4_matmul_f32(x, packed, scale_low)


def int4_matmul_q8_f32(x: Tensor, packed: Tensor, scale_zero: Tensor) -> Tensor:
    """`x @ W^T` for fp32 x [rows, K] (each row's inputs quantized per group of 32 to int8, as
    llama.cpp's Q8) and a `pack_int4_q8_f32` weight; fp32 [rows, N]."""
    return torch.ops.maskwire_kernels.int4_matmul_q8_f32(x, packed, scale_zero)


def int8_matmul_f32(x: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """`x @ W^T` for fp32 x [rows, K] and a `pack_int8_f32` weight; fp32 [rows, N]."""
    return torch.ops.maskwire_kernels.int8_matmul_f32(x, packed, scale)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, pos: Tensor) -> Tensor:
    """Softmax attention of q (bf16 or fp32 [B, H, R, D], as the cache; query row r is token
    r % T) over the cache slots `slots` [B] of k, v ([slots, H, L, D] views): query (b, r) attends
    positions 0..pos[b, r % T] (pos [B, T]; a position outside 0..L-1 is padding's and attends
    position 0 only). Scale 1/sqrt(D), as SDPA's default. `attention_available(dtype)` says
    where it runs."""
    if q.dtype == torch.float32:
        return torch.ops.maskwire_kernels.decode_attention_f32(q, k, v, slots, pos)
    return torch.ops.maskwire_kernels.decode_attention(q, k, v, slots, pos)
