"""Device backends for `--device cpu|cuda|xla`: where tensors live, how graphs compile, how to sync.

Everything device-specific in the engine goes through a `Backend`, so the step loop reads the same
on every device. XLA (torch_xla, and through its PJRT plugin AWS NeuronCores) is imported only
when asked for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from neuron_worker.compile_fallback import compile_or_eager

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

DEVICES = ("cpu", "cuda", "xla")

# Inductor's Python wrapper checks the size and stride of each op's output before passing it on:
# ~17 checks per layer, 0.7 ms of a 9.9 ms one-row decode step on a 2-core CPU (measured
# side by side with the same graph, same logits). The forward graphs' shapes are fixed by the
# model and its kernels' fake implementations, which the compiled-against-eager tests check.
LEAN_WRAPPER: dict[str, bool] = {
    "size_asserts": False,
    "alignment_asserts": False,
    "scalar_asserts": False,
}


def serving_guards(entries: Any) -> list[bool]:
    """The guards a serving graph keeps: not those on the model's modules (weights never change
    after loading: guarding on every module attribute costs ~1 ms per step for nothing), and not
    the global-state guard while generated kernels read the thread count when they run
    (`torch._inductor.config.cpp.dynamic_threads`, set with the thread governor): that guard
    holds the thread count, which the governor changes, beside grad mode, autocast and the
    default dtype, which the worker never changes. Input tensors (shapes, dtypes) stay guarded."""
    import torch._inductor.config  # with the compiler (see `compile_cache._inductor_config`)

    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    if not torch._inductor.config.cpp.dynamic_threads:
        return list(keep)
    return [k and e.guard_type != "GLOBAL_STATE" for k, e in zip(keep, entries, strict=True)]


class BackendError(RuntimeError):
    """The requested device is not usable here."""


class Backend:
    """A device plus its compile and synchronisation rules."""

    name = "cpu"
    # Eager ops are traced into graphs (XLA): a step must issue the same ops whatever the values
    # (an op run only on some steps would make each variation another graph to compile).
    traces_ops = False

    def __init__(self, *, compile: bool = False) -> None:
        self.compile_enabled = compile
        # Replay the compiled decode pass as captured CUDA graphs (`neuron_worker.cuda_graphs`).
        self.cuda_graphs = False
        self.device = torch.device("cpu")

    def compile(self, fn: F, *, name: str = "", dynamic: bool = False) -> F:
        """Compile `fn` for this device when compiling is on. `dynamic`: dimensions the caller
        marks (`torch._dynamo.mark_dynamic`) stay symbolic; else every shape is its own graph."""
        if not self.compile_enabled:
            return fn
        name = name or getattr(fn, "__name__", "fn")
        log.info("compiling %s with torch.compile", name)
        options: dict[str, Any] = {
            "guard_filter_fn": serving_guards,
            **LEAN_WRAPPER,
        }
        return compile_or_eager(
            fn,
            name=name,
            fullgraph=True,
            dynamic=None if dynamic else False,
            options=options,
        )

    def sync(self) -> None:
        """Wait until queued device work is done (timing and host reads)."""

    def inference_mode(self) -> contextlib.AbstractContextManager[object]:
        """The no-autograd context for device work."""
        return torch.inference_mode()

    def mark_step(self) -> None:
        """End of a lazily traced graph (XLA); nothing to do on eager devices."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device copy (no-op on CPU)."""
        return t if t.device == self.device else t.to(self.device, non_blocking=True)

    def describe(self) -> str:
        return self.name


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, *, compile: bool = False, cuda_graphs: bool = False) -> None:
        if not torch.cuda.is_available():
            raise BackendError("--device cuda: no CUDA device is visible to torch")
        super().__init__(compile=compile)
        self.cuda_graphs = cuda_graphs and compile
        self.device = torch.device("cuda", torch.cuda.current_device())

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        if t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        return f"cuda ({torch.cuda.get_device_name(self.device)})"


class XlaBackend(Backend):
    """torch_xla: graphs are traced lazily and cut at `mark_step`; compile = the XLA compiler.

    Each distinct traced graph (ops + shapes) is compiled once and cached, so the engine keeps
    every shape in static buckets and warms them all up before serving. `PJRT_DEVICE` picks the
    device (CPU here; NEURON with torch-neuronx on Trainium/Inferentia). Compile counts are
    exported as Prometheus series (`neuron_worker.xla`).
    """

    name = "xla"
    traces_ops = True

    def __init__(self, *, compile: bool = False) -> None:
        try:
            import torch_xla
        except ImportError as e:
            raise BackendError(
                "--device xla needs torch_xla (and torch-neuronx with PJRT_DEVICE=NEURON on AWS "
                "Trainium/Inferentia)"
            ) from e
        super().__init__(compile=compile)
        self._xla = torch_xla
        self.device = torch_xla.device()
        from neuron_worker import xla

        xla.register_prometheus()

    def compile(self, fn: F, *, name: str = "", dynamic: bool = False) -> F:
        # XLA compiles every traced graph already; torch.compile's openxla backend is optional.
        if not self.compile_enabled:
            return fn
        return torch.compile(fn, backend="openxla", dynamic=False)  # type: ignore[return-value]

    def mark_step(self) -> None:
        self._xla.sync()

    def sync(self) -> None:
        self._xla.sync(wait=True)

    def inference_mode(self) -> contextlib.AbstractContextManager[object]:
        # torch_xla rejects inference tensors ("Cannot set version_counter for inference tensor").
        return torch.no_grad()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def describe(self) -> str:
        import torch_xla.runtime as xr

        return f"xla ({xr.device_type()})"


def create_backend(
    device: str, *, compile: bool | None = None, cuda_graphs: bool = False
) -> Backend:
    """The backend for `--device`; `compile=None` means off (eager; `tuning.resolve` decides the
    worker's default). `cuda_graphs`: CUDA only, with `compile`."""
    if device not in DEVICES:
        raise BackendError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    if compile is None:
        compile = False
    if device == "cuda":
        return CudaBackend(compile=compile, cuda_graphs=cuda_graphs)
    if device == "xla":
        return XlaBackend(compile=compile)
    return Backend(compile=compile)
