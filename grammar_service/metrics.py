"""Prometheus metrics of the grammar service (served by `--metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_FAST = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
_SLOW = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)

COMPILE_SECONDS = Histogram(
    "maskwire_grammar_compile_seconds",
    "Time to compile one constraint (cache misses).",
    buckets=_SLOW,
)
COMPILE_ERRORS = Counter(
    "maskwire_grammar_compile_errors_total", "Constraints rejected at compile time.", ["reason"]
)
CACHE_LOOKUPS = Counter(
    "maskwire_grammar_cache_lookups_total", "Compile cache lookups.", ["result"]
)
CACHE_BYTES = Gauge(
    "maskwire_grammar_cache_bytes",
    "Estimated memory of the compiled grammars in the compile cache (--compile-cache-bytes).",
)
CACHE_ENTRIES = Gauge(
    "maskwire_grammar_cache_entries",
    "Compiled grammars in the compile cache (--compile-cache-size).",
)
STEP_SECONDS = Histogram(
    "maskwire_grammar_step_seconds", "Time to process one Step message.", buckets=_SLOW
)
MASK_SECONDS_PER_ROW = Histogram(
    "maskwire_grammar_mask_seconds_per_row",
    "Mask fill time of a step divided by its mask rows.",
    buckets=_FAST,
)
ROWS_PER_STEP = Histogram(
    "maskwire_grammar_rows_per_step",
    "Rows (requests) in one Step message.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
LIVE_SESSIONS = Gauge("maskwire_grammar_live_sessions", "Open Session streams.")
LIVE_REQUESTS = Gauge("maskwire_grammar_live_requests", "Requests open across all streams.")
POISON_REQUESTS = Counter(
    "maskwire_grammar_poison_requests_total",
    "Constraints refused because compiling them crashed a process of this service before.",
)
SANDBOX_CRASHES = Counter(
    "maskwire_grammar_sandbox_crashes_total",
    "Compile-sandbox children that died while compiling (each constraint is then poison).",
)
SANDBOX_KILLS = Counter(
    "maskwire_grammar_sandbox_kills_total",
    "Compile-sandbox children killed because their compile passed its deadline.",
)
SANDBOX_WORKERS = Gauge(
    "maskwire_grammar_sandbox_workers", "Compile-sandbox children ready to take a job."
)
BUDGET_KILLS = Counter(
    "maskwire_grammar_budget_kills_total",
    "Requests failed because their grammar work in one step passed --max-request-step-ms.",
)
SCHEMA_TOKENS_MASKED = Counter(
    "maskwire_grammar_schema_tokens_masked_total",
    "Tokens the output check masked off because they would complete a value violating the schema.",
)
SCHEMA_UNSATISFIED = Counter(
    "maskwire_grammar_schema_unsatisfied_total",
    "Requests ended because no continuation of their output validates (CONSTRAINT_UNSATISFIABLE).",
)
