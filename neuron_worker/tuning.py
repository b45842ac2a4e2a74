"""The worker's `auto` settings, decided once at start from the device and the checkpoint.

The defaults are the fast configuration (what `maskwire up` runs and the benchmarks measure):
compiled graphs, bf16 where the CPU computes it natively (fp32 elsewhere), quantized weights for
decode when the checkpoint's weights are 4-bit already (a Q4_1 GGUF: the 4-bit model is then the
checkpoint itself) and the CPU runs a 4-bit kernel for the chosen dtype (bf16: aten's or the
worker's own; fp32: the worker's own, AVX2), and a compile cache that survives restarts. Which
kernel each kind of projection then runs (4-bit, 8-bit, dense) is measured when the model loads
(`quantize` "auto": `neuron_worker.kernel_choice`), and on a CPU speculative decoding with n-gram
drafts (`speculative` "auto"). Every choice is logged, and each has a flag
that overrides it (eager and fp32 stay available for debugging and for the tests that compare
with transformers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from maskwire.config import ConfigError
from maskwire.gguf_file import Q4_1, GGUFFile
from maskwire.tokenizer import TokenizerLoadError, resolve_spec
from neuron_worker import kernels
from neuron_worker.compile_cache import default_root

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Tuning:
    dtype: torch.dtype
    compile: bool
    quantize: str  # none | int4 | int4a8 | int8 | auto (each kind timed at load: `kernel_choice`)
    warmup: bool
    compile_cache: Path | None
    overlap: bool
    speculative: str = "none"  # none | ngram
    cuda_graphs: bool = False

    def describe(self) -> str:
        return (
            f"dtype {str(self.dtype).removeprefix('torch.')}, "
            f"{'compiled' if self.compile else 'eager'}, quantize {self.quantize}, "
            f"CUDA graphs {'on' if self.cuda_graphs else 'off'}, "
            f"compile cache {self.compile_cache or 'off'}, "
            f"grammar overlap {'on' if self.overlap else 'off'}, "
            f"speculative {self.speculative}"
        )


def native_bf16(device: str) -> bool:
    """Whether bf16 matmuls run natively (CUDA; a CPU with AVX512-BF16 or AMX, which oneDNN
    reports): elsewhere bf16 is emulated and slower than fp32."""
    if device == "cuda":
        return True
    if device != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def fast_int4(dtype: torch.dtype) -> bool:
    """Whether 4-bit decode beats dense weights on this CPU for `dtype` activations: bf16 (native
    here, else fp32 would have been chosen), or fp32 where the worker's AVX2 kernel runs (aten's
    fp32 int4 path is scalar, ~14x slower than it)."""
    return dtype == torch.bfloat16 or (
        dtype == torch.float32 and kernels.cpu_kernel_set() is not None
    )


def q4_checkpoint(spec: str) -> bool:
    """Whether SPEC is a GGUF whose projection weights are stored as Q4_1."""
    try:
        path = resolve_spec(spec)
    except TokenizerLoadError:
        return False
    if path.suffix != ".gguf":
        return False
    try:
        tensors = GGUFFile(path).tensors
    except (ValueError, OSError):
        return False
    ffn = [t for name, t in tensors.items() if name.endswith("ffn_down.weight")]
    return bool(ffn) and all(t.ggml_type == Q4_1 for t in ffn)


def resolve(
    *,
    device: str,
    spec: str,
    dtype: str,
    compile: bool | None,
    quantize: str,
    warmup: bool | None,
    compile_cache: str | None,
    overlap: bool | None = None,
    speculative: str = "auto",
    tensor_parallel: int = 1,
    cuda_graphs: bool | None = None,
) -> Tuning:
    """Turn the flags (`auto` / None = decide here) into settings. `tensor_parallel` > 1: the
    sharded model runs eager with unquantized kernels (its collectives are not traced into
    compiled graphs, and the weight-only kernels quantize whole tensors)."""
    if tensor_parallel > 1:
        if device == "xla":
            raise ConfigError(
                "--tensor-parallel-size > 1 needs --device cpu or cuda: the XLA collectives "
                "(xm.all_reduce / all_gather over the Neuron TP group, docs/neuron.md) are not "
                "written yet"
            )
        if compile:
            raise ConfigError("--compile needs --tensor-parallel-size 1 (sharded models run eager)")
        if quantize not in ("auto", "none"):
            raise ConfigError(f"--quantize {quantize} needs --tensor-parallel-size 1")
        compile, quantize = False, "none"
    if dtype == "auto":
        resolved_dtype = torch.bfloat16 if native_bf16(device) else torch.float32
    else:
        resolved_dtype = DTYPES[dtype]
        if resolved_dtype == torch.bfloat16 and device == "cpu" and not native_bf16(device):
            log.warning(
                "--dtype bfloat16 on a CPU without native bf16 (no AVX512-BF16 or AMX): bf16 "
                "matmuls are emulated here and run slower than fp32 (`--dtype auto` picks fp32)"
            )
    compiled = compile if compile is not None else device in ("cpu", "cuda")
    if quantize == "auto":
        # Timed among int4, int8 and dense where the 4-bit model is the checkpoint and fast
        # (int4a8 rounds the activations: a forced choice only).
        eligible = device == "cpu" and fast_int4(resolved_dtype) and q4_checkpoint(spec)
        quantize = "auto" if eligible else "none"
    elif quantize != "none" and device != "cpu":
        raise ConfigError(f"--quantize {quantize} needs --device cpu (its kernels are CPU ones)")
    if quantize != "none" and resolved_dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"--quantize {quantize} needs bfloat16 or float32 activations")
    if quantize == "int4a8":
        kernel_set = kernels.cpu_kernel_set()
        runs = kernel_set is not None and (kernel_set.bf16 or resolved_dtype == torch.float32)
        if not runs:
            raise ConfigError(
                "--quantize int4a8 needs the worker's 8-bit-activation kernels: bfloat16 on a CPU "
                "with AVX512-BF16 and AVX512-VNNI, or float32 on one with AVX2"
            )
    cache: Path | None = None
    if compiled and compile_cache != "":
        cache = Path(compile_cache) if compile_cache else default_root()
    # Every graph a request can hit is built before the worker reports ready.
    warm = warmup if warmup is not None else (compiled or device == "xla")
    # CUDA graphs replay the compiled decode pass; they are captured at warm-up.
    graphable = device == "cuda" and compiled and warm
    if cuda_graphs and not graphable:
        raise ConfigError("--cuda-graphs needs --device cuda, compiled graphs and the warm-up")
    return Tuning(
        dtype=resolved_dtype,
        compile=compiled,
        quantize=quantize,
        warmup=warm,
        compile_cache=cache,
        # Overlap hides the grammar round trip (~1 ms) behind the forward, but then forced tokens
        # cost a pass of their own instead of riding with the sampled token: worth it only where
        # a forward takes a few ms (an accelerator), not on a CPU (7-20 ms per decode pass on
        # 2 cores, where overlap measured 1.02x).
        overlap=overlap if overlap is not None else device != "cpu",
        # On a CPU a decode pass reads every weight for one token, so a pass that verifies a few
        # drafts costs about what a plain one does (the 4-bit kernels read the weights once per
        # 8 rows; the verification budget keeps passes that narrow), and the gate declines drafts
        # that do not pay. On an accelerator the per-step host work of drafting measured a net
        # loss (docs/benchmarks.md), and on XLA every verification width is another graph.
        speculative=speculative if speculative != "auto" else _auto_speculative(device),
        cuda_graphs=cuda_graphs if cuda_graphs is not None else graphable,
    )


def _auto_speculative(device: str) -> str:
    return "ngram" if device == "cpu" else "none"
