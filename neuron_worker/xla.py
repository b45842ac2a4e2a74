"""torch_xla helpers: graph-compilation counts, read in-process and exported to Prometheus.

On XLA every distinct traced graph (ops and shapes) is compiled once and then served from the
in-memory graph cache. The worker keeps all shapes in static buckets and compiles them during
warm-up, so after startup the compilation count must stay flat; these readers make that
checkable (tests, benchmarks) and observable (`maskwire_worker_xla_compilations_total`).

torch_xla is imported lazily: this module is importable without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class CompileStats:
    """Process totals from torch_xla's debug metrics."""

    compilations: int  # graphs compiled by XLA (metric CompileTime, count)
    compile_s: float  # total compile time (metric CompileTime, sum)
    cache_hits: int  # traced graphs found in the in-memory graph cache (counter CachedCompile)
    executions: int  # graphs executed (metric ExecuteTime, count)

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            self.compilations - other.compilations,
            self.compile_s - other.compile_s,
            self.cache_hits - other.cache_hits,
            self.executions - other.executions,
        )


def compile_stats() -> CompileStats:
    """Current totals (zeros before the first graph)."""
    import torch_xla.debug.metrics as met

    compile_time = met.metric_data("CompileTime")
    execute_time = met.metric_data("ExecuteTime")
    return CompileStats(
        compilations=int(compile_time[0]) if compile_time else 0,
        compile_s=float(compile_time[1]) / 1e9 if compile_time else 0.0,
        cache_hits=int(met.counter_value("CachedCompile") or 0),
        executions=int(execute_time[0]) if execute_time else 0,
    )


class _CompileCollector(Collector):
    """Reads torch_xla's metrics at scrape time (they live in C++; nothing to update here)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = compile_stats()
        yield CounterMetricFamily(
            "maskwire_worker_xla_compilations",
            "XLA graphs compiled (flat after warm-up when every shape is bucketed)",
            value=stats.compilations,
        )
        yield CounterMetricFamily(
            "maskwire_worker_xla_compile_seconds",
            "Time spent compiling XLA graphs",
            value=stats.compile_s,
        )
        yield CounterMetricFamily(
            "maskwire_worker_xla_graph_cache_hits",
            "Traced graphs served from the compiled-graph cache",
            value=stats.cache_hits,
        )
        yield CounterMetricFamily(
            "maskwire_worker_xla_executions", "XLA graphs executed", value=stats.executions
        )


_registered = False


def register_prometheus(registry: prom.CollectorRegistry = prom.REGISTRY) -> None:
    """Export the compile counters on the worker's /metrics (idempotent)."""
    global _registered
    if not _registered:
        registry.register(_CompileCollector())
        _registered = True
