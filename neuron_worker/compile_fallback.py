"""Serve a function eager where the compiler fails on one of its graphs.

`torch.compile` can trace a function and then fail in its backend: inductor raised a `TypeError`
in its Triton code generation for one of the worker's graphs on CUDA with torch 2.11
(docs/benchmarks.md, "CUDA on an H200"). That is a bug in the installed compiler,
not in the request or the model. Such bugs sit in optional code paths of the compiler (that one in
persistent reductions, one row per program), so the function is first compiled again with those
paths turned off (`SAFER_SETTINGS`; WARNING log, `maskwire_worker_compile_retries_total`). If that
fails too, the eager function computes the same thing (the tests check every compiled graph
against it): the worker serves that function eager, says so at ERROR level with the function's
name and the compiler's error, and counts it (`maskwire_worker_eager_fallbacks_total`) instead of
failing its start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from neuron_worker.metrics import COMPILE_RETRIES, EAGER_FALLBACKS

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# Inductor settings that route around its optional code generation paths, for a second compile
# after the first failed. Persistent reductions (a whole row per program, which mix-order
# reductions force) are where torch 2.11's Triton shape propagation crashed on CUDA; the looped
# form is slower by a little, eager by a lot. Names this inductor lacks are left out.
SAFER_SETTINGS: dict[str, object] = {
    "triton.persistent_reductions": False,
    "triton.mix_order_reduction": False,
}


def _known_settings(settings: dict[str, object]) -> dict[str, object]:
    import torch._inductor.config as inductor

    known = {}
    for name, value in settings.items():
        obj: Any = inductor
        *path, leaf = name.split(".")
        for part in path:
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, leaf):
            known[name] = value
    return known


def _cause(e: Exception) -> str:
    cause = getattr(e, "inner_exception", None) or e
    return f"{type(cause).__name__}: {str(cause)[:500]}"


class CompiledOrEager:
    """`torch.compile(fn, **options)`; once its backend fails, `fn` compiled with inductor's
    `SAFER_SETTINGS`; once that fails too, `fn` itself."""

    def __init__(self, fn: Callable[..., Any], name: str, **options: Any) -> None:
        self.eager = fn
        self.name = name
        self.options = options
        self.compiled: Callable[..., Any] | None = torch.compile(fn, **_fresh(options))
        self.retried = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # `torch.compile` imported dynamo; this module does not, as importing it takes about a
        # second, which an eager worker does without.
        while self.compiled is not None:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                # The backend failed (a tracing error in our code would be `Unsupported` and is
                # raised: the tests trace every graph). Nothing of this call ran on the device.
                self._after_failure(e)
        return self.eager(*args, **kwargs)

    def _after_failure(self, e: Exception) -> None:
        inductor = self.options.get("backend", "inductor") == "inductor"
        safer = _known_settings(SAFER_SETTINGS) if inductor else {}
        if not self.retried and safer:
            self.retried = True
            log.warning(
                "the compiler failed on %s; compiling it again with %s: %s",
                self.name,
                safer,
                _cause(e),
            )
            COMPILE_RETRIES.labels(function=self.name).inc()
            options = {**self.options.get("options", {}), **safer}
            self.compiled = torch.compile(
                self.eager, **_fresh({**self.options, "options": options})
            )
            return
        log.error(
            "the compiler failed on %s; serving it eager from now on (slower, same results): %s",
            self.name,
            _cause(e),
        )
        EAGER_FALLBACKS.labels(function=self.name).inc()
        self.compiled = None


def _fresh(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with a copy of its inner "options": `torch.compile` pops the dynamo settings
    (`guard_filter_fn`) out of that dict, so a dict shared between calls would give every graph
    after the first the default guards (the one on the thread count included)."""
    inner = options.get("options")
    return {**options, "options": dict(inner)} if inner is not None else dict(options)


def compile_or_eager(fn: F, *, name: str, **options: Any) -> F:
    """`torch.compile(fn, **options)` that serves `fn` eager once its backend fails."""
    return CompiledOrEager(fn, name, **options)  # type: ignore[return-value]


def fallback_counts() -> dict[str, float]:
    """How many times each function fell back to eager in this process, by name."""
    return _by_function(EAGER_FALLBACKS)


def retry_counts() -> dict[str, float]:
    """How many times each function was compiled again with `SAFER_SETTINGS`, by name."""
    return _by_function(COMPILE_RETRIES)


def _by_function(counter: Any) -> dict[str, float]:
    return {
        sample.labels["function"]: sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
