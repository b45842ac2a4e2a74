"""Worker metrics: Prometheus series (scraped on `--metrics-port`) and in-process totals.

The totals (`EngineStats`) are what the benchmark reads; the Prometheus series carry the same
measurements for operators.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import prometheus_client as prom

_STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_WAIT_BUCKETS = (0.0, 0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)

STEP_SECONDS = prom.Histogram(
    "maskwire_worker_step_seconds", "Wall time of one decode step", buckets=_STEP_BUCKETS
)
FORWARD_SECONDS = prom.Histogram(
    "maskwire_worker_forward_seconds",
    "Wall time of one forward pass",
    ["kind"],  # prefill | refresh | decode | jump_forward | verify
    buckets=_STEP_BUCKETS,
)
MASK_WAIT_SECONDS = prom.Histogram(
    "maskwire_worker_mask_wait_seconds",
    "Time a step waited for grammar masks after its forward pass was done",
    buckets=_WAIT_BUCKETS,
)
SAMPLE_SECONDS = prom.Histogram(
    "maskwire_worker_sample_seconds", "Wall time of the sampler", buckets=_STEP_BUCKETS
)
BATCH_SIZE = prom.Histogram(
    "maskwire_worker_batch_size",
    "Requests in a decode step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
TOKENS = prom.Counter(
    "maskwire_worker_generated_tokens_total",
    "Completion tokens produced (rate() gives tokens/s)",
    ["kind"],  # sampled | forced
)
PROMPT_TOKENS = prom.Counter(
    "maskwire_worker_prompt_tokens_total",
    "Prompt tokens of admitted requests: `computed` by a prompt pass, or `reused` from K/V a "
    "KV slot held for the same prefix (the prefix cache; hit rate = reused / both)",
    ["source"],  # computed | reused
)
REFRESHED_TOKENS = prom.Counter(
    "maskwire_worker_refreshed_answer_tokens_total",
    "Tokens of finished answers rewritten into their KV slots by prompt passes while the worker "
    "was idle, so that a conversation's next turn reuses them (`--prefix-refresh-tokens`)",
)
FORWARD_PASSES = prom.Counter(
    "maskwire_worker_forward_passes_total", "Forward passes run", ["kind"]
)
DRAFT_TOKENS = prom.Counter(
    "maskwire_worker_draft_tokens_total",
    "Speculative draft tokens: proposed by the drafter or forced by the grammar (drafts of the "
    "bytes it forces after its jump-forward tokens), declined (the step was not worth a "
    "verification pass), kept for a verification pass, accepted by verification (acceptance rate "
    "= accepted / kept; tokens per forward pass = generated_tokens_total / forward_passes_total)",
    ["stage"],  # proposed | forced | declined | kept | accepted
)
QUEUE_DEPTH = prom.Gauge("maskwire_worker_queue_depth", "Requests waiting for a KV slot")
RUNNING = prom.Gauge("maskwire_worker_running_requests", "Requests holding a KV slot")
REQUESTS = prom.Counter(
    "maskwire_worker_requests_total", "Finished requests", ["finish_reason", "constrained"]
)
REJECTED = prom.Counter("maskwire_worker_rejected_total", "Requests refused", ["code"])
GRAMMAR_REPLAYS = prom.Counter(
    "maskwire_worker_grammar_replays_total",
    "Requests re-opened on another grammar replica after a failure",
)
GRAMMAR_REPLICA_DEATHS = prom.Counter(
    "maskwire_worker_grammar_replica_deaths_total",
    "Grammar replica processes that died under this worker; `attributed`: whether the death "
    "happened while the replica held a request's Open or first step (the request id is logged)",
    ["attributed"],
)
COMPILES_WHILE_SERVING = prom.Counter(
    "maskwire_worker_compiles_while_serving_total",
    "Graphs compiled after warm-up (a request waited for each): should stay 0",
)
COMPILE_RETRIES = prom.Counter(
    "maskwire_worker_compile_retries_total",
    "Compiled functions built a second time with inductor's safer settings because the first "
    "compile failed (the worker's log names the function and the error)",
    ["function"],
)
EAGER_FALLBACKS = prom.Counter(
    "maskwire_worker_eager_fallbacks_total",
    "Compiled functions served eager because the compiler failed on one of their graphs (the "
    "worker's log names the function and the error): should stay 0",
    ["function"],
)
POISON_REQUESTS = prom.Counter(
    "maskwire_worker_poison_requests_total",
    "Requests failed because their constraint crashed grammar replicas (it is never sent again)",
)


@dataclass
class EngineStats:
    """Running totals since start (seconds and counts)."""

    steps: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    mask_wait_s: float = 0.0
    sample_s: float = 0.0
    prefill_s: float = 0.0
    forward_passes: int = 0
    sampled_tokens: int = 0
    forced_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_reused: int = 0
    refreshed_answer_tokens: int = 0
    compiles_while_serving: int = 0
    draft_proposed: int = 0
    draft_forced: int = 0
    draft_declined: int = 0
    draft_kept: int = 0
    draft_accepted: int = 0

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class Metrics:
    """Records one engine's measurements into both its totals and the Prometheus series."""

    def __init__(self) -> None:
        self.stats = EngineStats()

    def step(self, seconds: float, batch: int) -> None:
        self.stats.steps += 1
        self.stats.step_s += seconds
        STEP_SECONDS.observe(seconds)
        BATCH_SIZE.observe(batch)

    def forward(self, kind: str, seconds: float) -> None:
        self.stats.forward_passes += 1
        if kind in ("prefill", "refresh"):
            self.stats.prefill_s += seconds
        else:
            self.stats.forward_s += seconds
        FORWARD_SECONDS.labels(kind).observe(seconds)
        FORWARD_PASSES.labels(kind).inc()

    def mask_wait(self, seconds: float) -> None:
        self.stats.mask_wait_s += seconds
        MASK_WAIT_SECONDS.observe(seconds)

    def sample(self, seconds: float) -> None:
        self.stats.sample_s += seconds
        SAMPLE_SECONDS.observe(seconds)

    def compiled_while_serving(self, graphs: int) -> None:
        self.stats.compiles_while_serving += graphs
        COMPILES_WHILE_SERVING.inc(graphs)

    def prompt_tokens(self, *, computed: int, reused: int) -> None:
        """Tokens of one prompt pass's rows: run through it, and taken from a slot's K/V."""
        self.stats.prompt_tokens_computed += computed
        self.stats.prompt_tokens_reused += reused
        PROMPT_TOKENS.labels("computed").inc(computed)
        PROMPT_TOKENS.labels("reused").inc(reused)

    def refreshed(self, tokens: int) -> None:
        """Answer tokens one idle prompt pass rewrote into their slot."""
        self.stats.refreshed_answer_tokens += tokens
        REFRESHED_TOKENS.inc(tokens)

    def tokens(self, sampled: int, forced: int) -> None:
        self.stats.sampled_tokens += sampled
        self.stats.forced_tokens += forced
        if sampled:
            TOKENS.labels("sampled").inc(sampled)
        if forced:
            TOKENS.labels("forced").inc(forced)

    def drafts(
        self,
        *,
        proposed: int = 0,
        forced: int = 0,
        declined: int = 0,
        kept: int = 0,
        accepted: int = 0,
    ) -> None:
        """Speculative decoding: drafts proposed by the drafter or forced by the grammar,
        declined by the speculation gate, kept by the grammar (and the length limits) for a
        verification pass, accepted by the sampler."""
        self.stats.draft_proposed += proposed
        self.stats.draft_forced += forced
        self.stats.draft_declined += declined
        self.stats.draft_kept += kept
        self.stats.draft_accepted += accepted
        stages = (
            ("proposed", proposed),
            ("forced", forced),
            ("declined", declined),
            ("kept", kept),
            ("accepted", accepted),
        )
        for stage, n in stages:
            if n:
                DRAFT_TOKENS.labels(stage).inc(n)

    def queue(self, waiting: int, running: int) -> None:
        QUEUE_DEPTH.set(waiting)
        RUNNING.set(running)

    def finished(self, reason: str, constrained: bool) -> None:
        REQUESTS.labels(reason, "true" if constrained else "false").inc()

    def rejected(self, code: str) -> None:
        REJECTED.labels(code).inc()

    def replayed(self, n: int = 1) -> None:
        GRAMMAR_REPLAYS.inc(n)
