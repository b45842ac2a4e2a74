"""The worker's compile cache (`neuron_worker.compile_cache`): its directories, damage, use."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from neuron_worker import compile_cache
from neuron_worker.compile_cache import (
    GRAPH_LAYOUT,
    damaged_entry,
    kernel_directory,
    use_directory,
    use_for_worker,
    worker_directory,
)
from neuron_worker.drafter import DraftConfig
from neuron_worker.engine_config import EngineConfig


def test_graphs_are_split_by_symbolic_ranges(tmp_path: Path) -> None:
    """Graphs compiled for other size ranges carry guards this worker would refuse."""
    plain = worker_directory(tmp_path, EngineConfig())
    spec = worker_directory(tmp_path, EngineConfig(speculative=DraftConfig()))
    wider = worker_directory(tmp_path, EngineConfig(max_batch=16))
    flat = worker_directory(tmp_path, EngineConfig(flat_tokens=64))
    longer = worker_directory(tmp_path, EngineConfig(max_seq_len=4096))
    assert plain.parent == tmp_path
    assert len({plain, spec, wider, flat, longer}) == 5
    # but not by what leaves the graphs' ranges alone
    assert worker_directory(tmp_path, replace(EngineConfig(), max_queue=1)) == plain
    # and by the graphs' layout: the same flags compile other ranges after an upgrade
    assert f"-layout{GRAPH_LAYOUT}-" in plain.name


def test_graphs_are_split_by_the_cpus_instruction_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's `-march=native` code from one CPU never reaches another through a shared
    cache; the same flags share it whatever the model name."""
    cpus = {
        "zen4": ("AMD EPYC 9R14", frozenset({"avx2", "avx512f", "avx512_bf16"})),
        "zen4 renamed": ("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"})),
        "skylake": ("Intel Xeon Platinum 8175M", frozenset({"avx2", "avx512f"})),
    }
    found = {}
    for name, cpu in cpus.items():
        monkeypatch.setattr(compile_cache, "cpu_model_and_flags", lambda cpu=cpu: cpu)
        found[name] = worker_directory(tmp_path, EngineConfig())
    assert found["zen4"] == found["zen4 renamed"] != found["skylake"]


def test_the_kernels_are_built_under_the_workers_cache_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a worker that compiles no graph keeps its C++ kernels across restarts."""
    monkeypatch.setattr(compile_cache, "_root", None)  # restored after the test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_directory() == tmp_path / "xdg" / "maskwire" / "compile" / "kernels"
    root = tmp_path / "root"
    assert use_for_worker(root, EngineConfig(), compiled=False, dynamic_threads=False) is None
    assert kernel_directory() == root / "kernels"
    assert not root.exists()  # nothing is written before the kernels are built


def test_a_usable_cache_directory_holds_inductors_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # torch's config modules are restored by their own patch(), not by monkeypatch
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        assert use_directory(tmp_path / "cache") == tmp_path / "cache"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
        assert torch._inductor.config.fx_graph_cache
        assert torch._functorch.config.enable_autograd_cache


def read_only_directory(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory anyway")
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o500)
    return parent / "cache"


@pytest.mark.parametrize("where", ["under a file", "in a read-only directory"])
def test_an_unwritable_cache_directory_is_a_warning_not_a_failure(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "under a file":
        blocker = tmp_path / "file"
        blocker.write_text("a file where the cache directory should be")
        cache = blocker / "cache"
    else:
        cache = read_only_directory(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    with caplog.at_level(logging.WARNING, logger="neuron_worker.compile_cache"):
        assert use_directory(cache) is None
    assert f"compile cache {cache} is not usable" in caplog.text
    assert "compiling without it" in caplog.text
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "before")


def test_damage_torch_would_fail_on_is_found(tmp_path: Path) -> None:
    inductor = tmp_path / "inductor"
    assert damaged_entry(inductor) is None  # no cache yet
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab" / "cab.py").write_text("def call(args):\n    return args\n")
    (inductor / "ab" / "cab.so").symlink_to(torch._C.__file__)  # a whole shared library
    (inductor / "locks").mkdir()
    (inductor / "locks" / "cab.lock").write_bytes(b"")  # lock files are empty
    (inductor / "fxgraph" / "xy").mkdir(parents=True)
    (inductor / "fxgraph" / "xy" / "entry").write_bytes(b"garbage torch detects itself")
    assert damaged_entry(inductor) is None
    library = Path(torch._C.__file__).read_bytes()

    def damaged(name: str, content: bytes | None) -> str | None:
        broken = tmp_path / "broken"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(inductor, broken, symlinks=True)
        (broken / name).unlink()
        if content is None:
            (broken / name).mkdir()
        else:
            (broken / name).write_bytes(content)
        return damaged_entry(broken)

    assert damaged("ab/cab.so", library[: len(library) // 2]) == (
        f"{tmp_path}/broken/ab/cab.so is not a whole shared library"
    )
    assert damaged("ab/cab.so", b"")
    assert damaged("ab/cab.so", None) == f"{tmp_path}/broken/ab/cab.so is a directory"
    assert damaged("ab/cab.py", b"") == f"{tmp_path}/broken/ab/cab.py is not a Python module"
    assert damaged("ab/cab.py", b"def call(args):\n    return (")
    assert damaged("ab/cab.py", b"\xf8\x00garbage")
    assert damaged("locks/cab.lock", None) == f"{tmp_path}/broken/locks/cab.lock is a directory"


# A worker's start-up in miniature: the compile cache, then a compiled graph, run in a process of
# its own (this one's inductor state stays as it is); it prints its result and cache use.
COMPILE = """
import json, logging, sys
from pathlib import Path
import torch
from neuron_worker.compile_cache import cache_use, use_directory
logging.basicConfig(level=logging.WARNING)
assert use_directory(Path(sys.argv[1])) is not None
x = torch.arange(8, dtype=torch.float32)
y = torch.compile(lambda x: x * 2 + 1)(x)
print(json.dumps({"right": torch.equal(y, x * 2 + 1), "cache_use": cache_use()}))
"""
ROOT = Path(__file__).resolve().parents[3]


def compile_with_cache(cache: Path) -> tuple[dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(cache)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("filled") / "cache"
    result, _ = compile_with_cache(cache)
    assert result == {"right": True, "cache_use": [0, 1]}
    return cache


def garble(file: Path, i: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if i % 2 else os.urandom(max(len(data), 16)))


def hollow(file: Path, i: int) -> None:
    if i % 2:
        file.write_bytes(b"")
    else:
        file.unlink()
        file.mkdir()


@pytest.mark.slow  # three real compiles in subprocesses: ~60 s on 2 cores
@pytest.mark.parametrize("damage", [garble, hollow], ids=["garbled", "hollow"])
def test_a_damaged_cache_is_compiled_again(
    damage: object, filled_cache: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(filled_cache, cache)
    files = sorted(p for p in (cache / "inductor").rglob("*") if p.is_file())
    kinds = {p.suffix for p in files}
    assert {".py", ".so", ".lock"} <= kinds and (cache / "inductor" / "fxgraph").is_dir()
    for i, file in enumerate(files):
        damage(file, i)  # type: ignore[operator]
    # torch alone recompiles a garbled cache (with a warning per FX graph entry) but fails on a
    # hollow one (IsADirectoryError on a lock; torch 2.13), and on kernels or modules garbled
    # while their FX graph entries are whole (test above): maskwire starts the cache afresh
    result, log = compile_with_cache(cache)
    assert result == {"right": True, "cache_use": [0, 1]}
    assert f"compile cache {cache} is damaged" in log and "compiling it again" in log
    assert damaged_entry(cache / "inductor") is None
    assert any((cache / "inductor" / "fxgraph").rglob("*"))


def test_a_cache_another_worker_uses_is_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache = tmp_path / "cache"
    (cache / "inductor" / "ab").mkdir(parents=True)
    (cache / "inductor" / "ab" / "cab.so").write_bytes(b"")  # being compiled by the other one
    other = os.open(cache / ".in-use", os.O_RDWR | os.O_CREAT)  # the other worker's lock
    try:
        fcntl.flock(other, fcntl.LOCK_SH)
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
            caplog.at_level(logging.WARNING, logger="neuron_worker.compile_cache"),
        ):
            assert use_directory(cache) == cache
        assert (cache / "inductor" / "ab" / "cab.so").exists() and not caplog.text
    finally:
        os.close(other)
    # once the other worker is gone, the next start finds the damage and removes it
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        caplog.at_level(logging.WARNING, logger="neuron_worker.compile_cache"),
    ):
        assert use_directory(cache) == cache
    assert "is not a whole shared library" in caplog.text
    assert not (cache / "inductor").exists()


def test_the_compiler_settings_hold_on_the_thread_that_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's compiler settings set by assignment are thread-local: set on the event loop's
    thread they would not reach the device thread, where every graph is compiled (its kernels
    would be generated for a fixed team and its guards would refuse the governor's sizes)."""
    import argparse
    import asyncio

    from neuron_worker import app, device_thread
    from neuron_worker.cli import add_arguments
    from neuron_worker.config import worker_config

    monkeypatch.setattr(compile_cache, "_root", None)  # restored after the test
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--compile-cache", str(tmp_path), "--disable-structured-outputs"]
    config = worker_config(parser.parse_args(flags))
    assert config.tuning.compile and config.model.adaptive_threads

    def seen() -> tuple[bool, bool]:
        return torch._inductor.config.cpp.dynamic_threads, torch._inductor.config.fx_graph_cache

    try:
        assert asyncio.run(app.use_compile_cache_on_device_thread(config)) is not None
        assert asyncio.run(device_thread.run(seen)) == (True, True)
    finally:
        device_thread.executor().submit(
            lambda: setattr(torch._inductor.config.cpp, "dynamic_threads", False)
        ).result()
