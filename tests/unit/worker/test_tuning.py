"""The worker's `auto` settings (`neuron_worker.tuning`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from maskwire.config import ConfigError
from neuron_worker import compile_cache, kernels, tuning
from neuron_worker.tuning import resolve


def settings(device: str = "cpu", spec: str = "default", **flags: object) -> tuning.Tuning:
    args: dict[str, object] = {
        "dtype": "auto",
        "compile": None,
        "quantize": "auto",
        "warmup": None,
        "compile_cache": None,
    }
    args.update(flags)
    return resolve(device=device, spec=spec, **args)  # type: ignore[arg-type]


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "native_bf16", lambda device: True)


def test_the_default_on_a_bf16_cpu_is_compiled_bf16_timed_kernels_with_a_cache(
    bf16_cpu: None,
) -> None:
    # "auto": each kind of projection takes the decode kernel timed fastest at load
    t = settings()
    assert (t.dtype, t.compile, t.quantize, t.warmup) == (torch.bfloat16, True, "auto", True)
    assert t.compile_cache == compile_cache.default_root()
    assert "dtype bfloat16, compiled, quantize auto" in t.describe()
    # a CPU forward dwarfs the grammar round trip: forced tokens ride with the sampled one
    assert not t.overlap and "grammar overlap off" in t.describe()
    assert settings(overlap=True).overlap
    # a decode pass reads every weight for one token: verifying a few drafts costs little more
    assert t.speculative == "ngram" and "speculative ngram" in t.describe()
    assert settings(speculative="none").speculative == "none"
    assert settings(device="cuda").speculative == "none"


def test_without_native_bf16_the_default_is_fp32_with_the_avx2_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tuning, "native_bf16", lambda device: False)
    monkeypatch.setattr(kernels, "cpu_kernel_set", lambda: kernels.KERNEL_SETS[-1])
    t = settings()
    assert (t.dtype, t.compile, t.quantize) == (torch.float32, True, "auto")
    # no kernel for fp32 here: aten's fp32 int4 is slower than dense weights
    monkeypatch.setattr(kernels, "cpu_kernel_set", lambda: None)
    t = settings()
    assert (t.dtype, t.compile, t.quantize) == (torch.float32, True, "none")


def test_int4a8_needs_the_vnni_kernels_for_bf16_or_the_avx2_ones_for_fp32(
    bf16_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "cpu_kernel_set", lambda: kernels.KERNEL_SETS[0])
    assert settings(quantize="int4a8").quantize == "int4a8"
    assert settings(quantize="int4a8", dtype="float32").quantize == "int4a8"
    monkeypatch.setattr(kernels, "cpu_kernel_set", lambda: kernels.KERNEL_SETS[-1])  # AVX2
    with pytest.raises(ConfigError, match="AVX512-VNNI"):
        settings(quantize="int4a8")  # bf16 here: no VNNI kernel
    assert settings(quantize="int4a8", dtype="float32").quantize == "int4a8"
    monkeypatch.setattr(kernels, "cpu_kernel_set", lambda: None)
    with pytest.raises(ConfigError, match="8-bit-activation kernels"):
        settings(quantize="int4a8", dtype="float32")


def test_timed_kernels_only_for_a_q4_1_checkpoint(bf16_cpu: None, tmp_path: Path) -> None:
    assert tuning.q4_checkpoint("default")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    assert not tuning.q4_checkpoint(str(not_gguf))
    assert not tuning.q4_checkpoint(str(tmp_path))  # a directory (HF checkpoint)
    assert settings(spec=str(tmp_path)).quantize == "none"


def test_flags_override_and_contradictions_are_refused(bf16_cpu: None) -> None:
    t = settings(dtype="float32", compile=False, quantize="none", compile_cache="")
    assert (t.dtype, t.compile, t.quantize, t.warmup, t.compile_cache) == (
        torch.float32,
        False,
        "none",
        False,
        None,
    )
    assert "eager" in t.describe() and "compile cache off" in t.describe()
    assert settings(dtype="float32", quantize="int4").quantize == "int4"
    with pytest.raises(ConfigError, match="needs bfloat16 or float32"):
        settings(dtype="float16", quantize="int4")
    with pytest.raises(ConfigError, match="needs --device cpu"):
        settings(device="cuda", quantize="int8")


def test_tensor_parallel_runs_eager_and_unquantized(bf16_cpu: None) -> None:
    t = settings(tensor_parallel=2)
    assert (t.dtype, t.compile, t.quantize, t.warmup) == (torch.bfloat16, False, "none", False)
    assert t.compile_cache is None
    with pytest.raises(ConfigError, match="--compile needs --tensor-parallel-size 1"):
        settings(tensor_parallel=2, compile=True)
    with pytest.raises(ConfigError, match="--quantize int4 needs --tensor-parallel-size 1"):
        settings(tensor_parallel=2, quantize="int4")
    with pytest.raises(ConfigError, match="XLA collectives"):
        settings(device="xla", tensor_parallel=2)


def test_cuda_graphs_are_the_compiled_cuda_default_and_refused_elsewhere() -> None:
    assert settings(device="cuda").cuda_graphs
    assert "CUDA graphs on" in settings(device="cuda").describe()
    assert not settings(device="cuda", cuda_graphs=False).cuda_graphs
    # they replay compiled graphs captured at warm-up
    assert not settings(device="cuda", compile=False).cuda_graphs
    assert not settings(device="cuda", warmup=False).cuda_graphs
    assert not settings().cuda_graphs and "CUDA graphs off" in settings().describe()
    for flags in ({"device": "cpu"}, {"device": "cuda", "compile": False}, {"device": "xla"}):
        with pytest.raises(ConfigError, match="--cuda-graphs needs --device cuda"):
            settings(cuda_graphs=True, **flags)


def test_xla_is_bucketed_eager_torch_with_warm_up() -> None:
    t = settings(device="xla")
    assert (t.dtype, t.compile, t.quantize, t.warmup) == (torch.float32, False, "none", True)
    assert t.overlap and not settings(device="xla", overlap=False).overlap
