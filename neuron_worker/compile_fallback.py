"""Serve a function eager where the compiler fails on one of its graphs.

`torch.compile` can trace a function and then fail in its backend: inductor raised a `TypeError`
in its Triton code generation for one of the worker's graphs on CUDA with torch 2.11
(docs/benchmarks.md, "CUDA: the first run on hardware"). That is a bug in the installed compiler,
not in the request or the model, and the eager function computes the same thing (the tests check
every compiled graph against it), so the worker serves that function eager, says so at ERROR
level with the function's name and the compiler's error, and counts it
(`maskwire_worker_eager_fallbacks_total`) instead of failing its start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._dynamo.exc

from neuron_worker.metrics import EAGER_FALLBACKS

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class CompiledOrEager:
    """`torch.compile(fn, **options)` until its backend fails once, then `fn` itself."""

    def __init__(self, fn: Callable[..., Any], name: str, **options: Any) -> None:
        self.eager = fn
        self.name = name
        self.compiled: Callable[..., Any] | None = torch.compile(fn, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # The backend failed (a tracing error in our code would be `Unsupported` and is
            # raised: the tests trace every graph). Nothing of this call ran on the device.
            cause = getattr(e, "inner_exception", None) or e
            log.error(
                "the compiler failed on %s; serving it eager from now on (slower, same "
                "results): %s: %s",
                self.name,
                type(cause).__name__,
                str(cause)[:500],
            )
            EAGER_FALLBACKS.labels(function=self.name).inc()
            self.compiled = None
            return self.eager(*args, **kwargs)


def compile_or_eager(fn: F, *, name: str, **options: Any) -> F:
    """`torch.compile(fn, **options)` that serves `fn` eager once its backend fails."""
    return CompiledOrEager(fn, name, **options)  # type: ignore[return-value]


def fallback_counts() -> dict[str, float]:
    """How many times each function fell back to eager in this process, by name."""
    return {
        sample.labels["function"]: sample.value
        for metric in EAGER_FALLBACKS.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
