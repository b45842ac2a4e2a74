"""The worker's `auto` settings and its compile cache directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from neuron_worker import tuning
from neuron_worker.tuning import resolve, use_compile_cache


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


def test_the_default_on_a_bf16_cpu_is_compiled_bf16_int4_with_a_cache(bf16_cpu: None) -> None:
    t = settings()
    assert (t.dtype, t.compile, t.quantize, t.warmup) == (torch.bfloat16, True, "int4", True)
    assert t.compile_cache == tuning.default_compile_cache()
    assert "dtype bfloat16, compiled, quantize int4" in t.describe()
    # a CPU forward dwarfs the grammar round trip: forced tokens ride with the sampled one
    assert not t.overlap and "grammar overlap off" in t.describe()
    assert settings(overlap=True).overlap


def test_without_native_bf16_the_default_is_fp32_and_unquantized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tuning, "native_bf16", lambda device: False)
    t = settings()
    assert (t.dtype, t.compile, t.quantize) == (torch.float32, True, "none")


def test_int4_auto_only_for_a_q4_1_checkpoint(bf16_cpu: None, tmp_path: Path) -> None:
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
    with pytest.raises(SystemExit, match="needs bfloat16"):
        settings(dtype="float32", quantize="int4")
    with pytest.raises(SystemExit, match="needs --device cpu"):
        settings(device="cuda", quantize="int8")


def test_xla_is_bucketed_eager_torch_with_warm_up() -> None:
    t = settings(device="xla")
    assert (t.dtype, t.compile, t.quantize, t.warmup) == (torch.float32, False, "none", True)
    assert t.overlap and not settings(device="xla", overlap=False).overlap


def test_a_usable_cache_directory_holds_inductors_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # torch's config modules are restored by their own patch(), not by monkeypatch
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        assert use_compile_cache(tmp_path / "cache") == tmp_path / "cache"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
        assert torch._inductor.config.fx_graph_cache
        assert torch._functorch.config.enable_autograd_cache


def test_an_unusable_cache_directory_is_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="neuron_worker.tuning"):
        assert use_compile_cache(blocker / "cache") is None
    assert "is not usable" in caplog.text and "compiling without it" in caplog.text
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
