"""The worker's compile cache: one directory (`--compile-cache`) that keeps what compiling costs
across restarts, so a restart loads instead of compiling.

Under the cache's root:

* `<ranges>/inductor/`: inductor's on-disk caches (FX graphs, AOT autograd, generated kernels),
  one `<ranges>` directory per set of symbolic size ranges and CPU (`worker_directory`);
* `<ranges>/graphs/`: the forward graphs saved whole (`neuron_worker.saved_graphs`; CPU only);
* `kernels/`: the worker's own C++ kernels (`neuron_worker.kernels` asks `kernel_directory`).

An unusable directory is a warning, not a failure: the worker then compiles into a temporary
cache. So is a damaged one (see `damaged_entry`): its inductor caches are removed and the worker
compiles again. This module imports no other worker module but the engine's settings: the
kernels, the saved graphs and the start-up settings (`neuron_worker.tuning`) all ask it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from maskwire.cpus import cpu_model_and_flags
from neuron_worker.engine_config import EngineConfig

log = logging.getLogger(__name__)

# The layout of the dynamic forward graphs (`neuron_worker.graphs`): their kinds and symbolic
# ranges. torch's FX graph cache keys a graph without the ranges it was compiled for, so graphs
# of another layout must not share a directory (`worker_directory`). Bump it when a kind's
# range changes.
GRAPH_LAYOUT = 2

_root: Path | None = None  # the worker's cache root, once `use_for_worker` has run


def default_root() -> Path:
    """`$XDG_CACHE_HOME/maskwire/compile` (`--compile-cache`'s default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "maskwire" / "compile"


def kernel_directory() -> Path:
    """Where the worker's own kernels are built: under the worker's cache root, else under the
    default root (the kernels are built whether or not the graphs are compiled)."""
    return (_root or default_root()) / "kernels"


def worker_directory(root: Path, engine: EngineConfig) -> Path:
    """The subdirectory for this worker's symbolic size ranges (rows, sequence, logits rows per
    row, flat passes). torch's FX graph cache does not key on the ranges a dimension was marked
    dynamic with, and a graph compiled for rows <= 8 carries that bound as a guard: loaded by a
    worker whose rows go to 40, dynamo refuses it (ConstraintViolationError at warm-up). `engine`
    is the configuration as the flags give it (before it is fitted to the model's context).

    And per CPU (its instruction-set flags): inductor compiles its C++ with `-march=native` and
    keys its caches by the command line, not by what `native` meant, so a cache shared between
    hosts (a volume several nodes mount) would hand one CPU's code to another that may lack its
    instructions."""
    # Flat passes' rows go up to it; "auto": the runner's default (`graphs.default_flat_tokens`).
    flat = "auto" if engine.flat_tokens is None else engine.flat_tokens
    ranges = (
        f"rows{engine.max_batch}-slots{engine.kv_slots}-seq{engine.max_seq_len}"
        f"-verify{engine.verify_width}-flat{flat}"
    )
    flags = " ".join(sorted(cpu_model_and_flags()[1]))
    cpu = hashlib.sha256(flags.encode()).hexdigest()[:8]
    return root / f"{ranges}-layout{GRAPH_LAYOUT}-cpu{cpu}"


def use_for_worker(
    root: Path | None, engine: EngineConfig, *, compiled: bool, dynamic_threads: bool
) -> Path | None:
    """Point the compiled graphs and the kernels at the cache under `root` (None: no cache);
    returns the directory of this worker's graphs (None: not compiled, or no usable cache).
    `dynamic_threads` (adaptive threads on CPU): generated kernels read the team size when they
    run, not when compiled, so the thread governor's size holds for them too, and graphs (keyed
    by it, `saved_graphs.graph_key`) are not shared with workers that compile without it."""
    global _root
    _root = root
    if not compiled:
        return None
    _inductor_config().cpp.dynamic_threads = dynamic_threads
    if root is None:
        return None
    return use_directory(worker_directory(root, engine))


def graph_directory(cache: Path | None, device: str) -> Path | None:
    """Where the forward graphs are saved whole, to load without re-tracing the model. CPU
    only: torch's precompile API has not run on the other devices here."""
    return cache / "graphs" if cache is not None and device == "cpu" else None


def use_directory(path: Path) -> Path | None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, generated kernels) at `path`;
    returns it, or None when it is not usable (the worker then compiles without it)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".writable"
        probe.write_text("ok")
        probe.unlink()
        inductor = path / "inductor"
        if _sole_user(path) and (damage := damaged_entry(inductor)):
            log.warning("compile cache %s is damaged (%s): compiling it again", path, damage)
            shutil.rmtree(inductor)
    except OSError as e:
        log.warning("compile cache %s is not usable (%s): compiling without it", path, e)
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    _inductor_config().fx_graph_cache = True
    import torch._functorch.config

    torch._functorch.config.enable_autograd_cache = True
    return path


def _inductor_config() -> Any:
    # Imported when a compiled worker needs it: importing inductor (and dynamo with it) takes
    # about a second, which an eager worker does without.
    import torch._inductor.config

    return torch._inductor.config


_in_use: dict[Path, int] = {}  # cache directory -> the open lock file that marks it in use


def _sole_user(path: Path) -> bool:
    """Mark `path` in use by this process for its lifetime (a shared lock), and say whether no
    other process had it in use: only then may damaged entries be removed, as a kernel that
    another worker is compiling right now is half-written, not damaged."""
    fd = _in_use.get(path)
    if fd is None:
        fd = _in_use[path] = os.open(path / ".in-use", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)
    return True


def damaged_entry(inductor: Path) -> str | None:
    """The first entry of an inductor cache that torch would fail on instead of compiling
    again, described, or None. torch detects a damaged FX graph or AOT autograd entry itself (a
    warning, then a compile), but trusts the generated modules and kernels that those entries
    name: an empty or garbled `.py` or `.so`, or a directory where a module, kernel or lock
    file belongs, stops the compile with an exception (torch 2.13, measured)."""
    if not inductor.is_dir():
        return None
    for root, dirs, files in os.walk(inductor):
        for name in dirs:
            if Path(name).suffix in (".py", ".so", ".lock"):
                return f"{Path(root, name)} is a directory"
        for name in files:
            file = Path(root, name)
            if file.suffix == ".so" and not _whole_elf(file):
                return f"{file} is not a whole shared library"
            if file.suffix == ".py" and not _python_source(file):
                return f"{file} is not a Python module"
    return None


def _whole_elf(file: Path) -> bool:
    """Whether `file` starts with a 64-bit ELF header whose section headers lie inside it (a
    truncated library fails this)."""
    with file.open("rb") as f:
        header = f.read(64)
    if len(header) < 64 or header[:5] != b"\x7fELF\x02":
        return False
    order = "<" if header[5] == 1 else ">"
    (shoff,) = struct.unpack_from(order + "Q", header, 0x28)
    shentsize, shnum = struct.unpack_from(order + "HH", header, 0x3A)
    return bool(shoff + shentsize * shnum <= file.stat().st_size)


def _python_source(file: Path) -> bool:
    """Whether `file` is non-empty, UTF-8 and compiles."""
    try:
        source = file.read_bytes().decode()
        compile(source, str(file), "exec", dont_inherit=True)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return False
    return bool(source.strip())


def count_saved_graph(what: str) -> None:
    """Count a saved forward graph `loaded` or `compiled` (`neuron_worker.saved_graphs`)."""
    from torch._dynamo.utils import counters

    counters["saved_graphs"][what] += 1


def saved_graph_counts() -> tuple[int, int]:
    """(graphs loaded from saved files, graphs compiled and saved) in this process so far."""
    from torch._dynamo.utils import counters

    c = counters["saved_graphs"]
    return int(c["loaded"]), int(c["compiled"])


def cache_use() -> tuple[int, int]:
    """(graphs loaded from the compile cache, graphs compiled) in this process so far: inductor's
    FX graph cache counters plus the saved forward graphs."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    loaded, compiled = saved_graph_counts()
    return (
        int(inductor["fxgraph_cache_hit"]) + loaded,
        int(inductor["fxgraph_cache_miss"]) + compiled,
    )
