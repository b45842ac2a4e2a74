"""The forward's compiled graphs, saved whole in the compile cache so that a restart loads them
instead of tracing the model again.

Inductor's caches keep the generated kernels, but `torch.compile` still re-traces the model with
dynamo at every start to find them: 6-9 s per forward graph for SmolLM2's 30 layers on 2 cores,
most of a warm start. torch's precompile API (`aot_compile`, experimental in torch 2.13) saves a
graph with its guards and kernels in one file, which loads without tracing (~2.7 s).

`SavedGraphs` holds one such graph per kind of pass (`graphs.graph_kind`).
Each is loaded from `<dir>/<kind>-<key>.bin` when that file exists, else compiled at its first
call (warm-up) and saved there. The key covers everything the graph depends on that its guards do
not check (they check the inputs only; the model's modules are not guarded): the model's
structure (every module's settings, every weight's shape and dtype), the model and kernel
sources, the symbolic size ranges, torch, Python, the CPU's vector ISA and the thread count. A
file that fails to load is compiled again; an unwritable directory only costs the saving; a call
whose inputs the saved guards refuse runs on a `torch.compile` graph compiled for it instead,
which the compile counter then counts (`graphs.CompileCounter`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from neuron_worker.backends import LEAN_WRAPPER, serving_guards
from neuron_worker.compile_cache import count_saved_graph

log = logging.getLogger(__name__)

# The sources a forward graph is traced from: a change in any of them changes the key.
_SOURCE_PACKAGES = ("neuron_worker.model", "neuron_worker.kernels")
_SOURCE_SUFFIXES = (".py", ".cpp", ".h")
# torch's own traced modules are covered by its version in the key.
_KEYED_ELSEWHERE = ("torch.",)
# What decides how a graph is compiled and which guards it keeps (a graph saved under an older
# guard policy would refuse inputs the current one accepts, e.g. a new intra-op team size).
_POLICY_SOURCES = ("neuron_worker/backends.py", "neuron_worker/saved_graphs.py")


def _portable_guards(entries: Sequence[Any]) -> list[bool]:
    # Guards that can be saved (input tensors' metadata, symbolic shapes, global state), less
    # those a serving graph drops (`backends.serving_guards`).
    serving = serving_guards(entries)
    portable = torch.compiler.keep_portable_guards_unsafe(entries)
    return [a and b for a, b in zip(serving, portable, strict=True)]


class SavedGraphs:
    """The model's pass functions (`step_logits`, `prefill_logits`) compiled once per graph
    kind, loaded from / saved to `directory`."""

    def __init__(
        self,
        model: nn.Module,
        directory: Path,
        *,
        ranges: str,
        mark_dynamic: Callable[[str, tuple[torch.Tensor, ...]], None],
        fallbacks: Mapping[str, Callable[..., torch.Tensor]],
    ) -> None:
        """`mark_dynamic(kind, args)`: marks the symbolic dimensions of a `kind` pass's inputs
        (within `ranges`, which is part of the key); `fallbacks`: for each pass function's
        name, its `torch.compile`d form, for inputs that a saved graph's guards refuse."""
        self.model = model
        self.directory = directory
        self._mark_dynamic = mark_dynamic
        self._fallbacks = dict(fallbacks)
        self._key = graph_key(model, ranges)
        self._graphs: dict[str, Any] = {}  # kind -> AOTCompiledFunction, None: not compilable
        self._refused: set[str] = set()  # kinds whose guards refused a call (logged once)
        self._compilers: dict[str, Any] = {}  # function name -> torch.compile'd, for aot_compile

    def path(self, kind: str) -> Path:
        """`<kind>-<key>.bin` (a kind has no "-": the stale-file glob relies on it)."""
        return self.directory / f"{kind}-{self._key}.bin"

    def __call__(self, kind: str, function: str, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run the `kind` graph of the model's `function` on `args` (not marked dynamic: a
        loaded graph's guards refuse marked tensors), loading or compiling it at its first
        call. A kind always names the same function."""
        if kind not in self._graphs:
            self._graphs[kind] = self._load(kind) or self._compile_and_save(kind, function, args)
        graph = self._graphs[kind]
        if graph is None:  # it could not be compiled this way
            return self._run_fallback(kind, function, args)
        if not graph.guard_check(self.model, *args):
            if kind not in self._refused:
                self._refused.add(kind)
                log.warning(
                    "saved graph %s refuses these inputs (%s): compiling",
                    kind,
                    _why(graph, self.model, *args),
                )
            return self._run_fallback(kind, function, args)
        return cast(torch.Tensor, graph(self.model, *args))

    def _run_fallback(
        self, kind: str, function: str, args: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        self._mark_dynamic(kind, args)
        return self._fallbacks[function](*args)

    def _load(self, kind: str) -> Any | None:
        path = self.path(kind)
        try:
            with path.open("rb") as f:
                graph: Any = torch.compiler.load_compiled_function(
                    f, external_data={"model": self.model}
                )
        except FileNotFoundError:
            return None
        except Exception as e:  # any damage means: compile it again
            log.warning("saved graph %s does not load (%s): compiling it again", path, e)
            return None
        graph.disable_guard_check()  # `__call__` checks them, to fall back instead of raising
        count_saved_graph("loaded")
        return graph

    def _compile_and_save(self, kind: str, function: str, args: tuple[torch.Tensor, ...]) -> Any:
        example = tuple(a.clone() for a in args)  # marked for the compile only
        self._mark_dynamic(kind, example)
        if function not in self._compilers:
            self._compilers[function] = torch.compile(  # `aot_compile` is not in its type yet
                cast(Callable[..., torch.Tensor], getattr(self.model, function)),
                fullgraph=True,
                dynamic=None,  # the dimensions the caller marks are symbolic
                options={"guard_filter_fn": _portable_guards, **LEAN_WRAPPER},
            )
        try:
            graph = self._compilers[function].aot_compile((example, {}))
        except Exception as e:  # an experimental API: serve with torch.compile instead
            log.warning("graph %s cannot be precompiled (%s): compiling it each start", kind, e)
            return None
        graph.disable_guard_check()
        count_saved_graph("compiled")
        unkeyed = sorted(
            s.module
            for s in graph.source_info().inlined_sources
            if not s.module.startswith(_SOURCE_PACKAGES + _KEYED_ELSEWHERE)
        )
        if unkeyed:  # its key would not change with these sources: never reuse it
            log.warning("graph %s traced %s: not saved", kind, ", ".join(unkeyed))
            return graph
        path = self.path(kind)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{kind}-*.bin"):
                if stale != path:  # an older key (an upgrade): never loaded again
                    stale.unlink(missing_ok=True)
            graph.save_compiled_function(str(path), external_data={"model": self.model})
        except Exception as e:  # a full disk, a read-only volume, an unpicklable graph
            log.warning(
                "graph %s not saved to %s (%s): it compiles again next start", kind, path, e
            )
        return graph


def _why(graph: Any, *args: Any) -> str:
    """The first guard of `graph` that `args` fail, as torch words it."""
    f_locals = graph.prepare_f_locals(*args)
    return "; ".join(graph._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)


def graph_key(model: nn.Module, ranges: str) -> str:
    """A digest of what a saved forward graph depends on besides its guarded inputs."""
    import torch._inductor.config  # with the compiler (see `compile_cache._inductor_config`)

    h = hashlib.sha256()
    for part in (
        torch.__version__,
        sys.version,
        str(torch.backends.cpu.get_cpu_capability()),
        str(torch.get_num_threads()),  # inductor's C++ kernels are generated for a thread count
        str(torch._inductor.config.cpp.dynamic_threads),  # ... or read it when they run
        ranges,
        str(sorted(LEAN_WRAPPER.items())),  # how inductor wrote the graph's wrapper
        _model_structure(model),
        *_source_digests(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _model_structure(model: nn.Module) -> str:
    """Every module's type and plain settings, and every tensor's name, shape and dtype."""
    lines = []
    for name, module in model.named_modules():
        settings = {
            k: v
            for k, v in sorted(vars(module).items())
            if isinstance(v, (bool, int, float, str, type(None))) and k != "training"
        }
        lines.append(f"{name} {type(module).__qualname__} {settings}")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        lines.append(f"{name} {tuple(t.shape)} {t.dtype}")
    return "\n".join(lines)


def _source_digests() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    files = sorted(
        p
        for package in _SOURCE_PACKAGES
        for p in (root / package.replace(".", os.sep)).rglob("*")
        if p.suffix in _SOURCE_SUFFIXES
    )
    files += [root / name for name in _POLICY_SOURCES]
    return [f"{p.relative_to(root)} {hashlib.sha256(p.read_bytes()).hexdigest()}" for p in files]
