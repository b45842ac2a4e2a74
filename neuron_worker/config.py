"""The worker's configuration: one frozen `WorkerConfig`, built from the flags and checked in one
place (`worker_config`), then passed down whole.

Each setting's default is defined once, on its dataclass field here, in `EngineConfig` or in
`DraftConfig`; the flags (`neuron_worker.cli`) read their defaults from those fields. A flag whose
default is `auto` is resolved here too (`neuron_worker.tuning` decides the speed settings), so the
object holds what the worker runs. Only the context is fitted later, once the model says how long
its own is (`fit_context`).

This module stays light (the CLI imports it to build its parser): torch is imported when a
configuration is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskwire.config import ConfigError
from maskwire.discovery import DEFAULT_REFRESH_S, TargetError, parse_targets
from maskwire.server_args import ServerConfig, server_config
from maskwire.text import DEFAULT_MAX_PROMPT_BYTES
from maskwire.tls import ClientTLS, client_tls_from_args
from neuron_worker.drafter import DEFAULT_SIZES, DraftConfig, DraftMatch
from neuron_worker.engine_config import EngineConfig

if TYPE_CHECKING:
    from neuron_worker.tuning import Tuning

__all__ = [
    "ConfigError",
    "GrammarSettings",
    "ModelSettings",
    "PromptLimits",
    "WorkerConfig",
    "fit_context",
    "worker_config",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051
DEFAULT_DRAIN_GRACE_S = 10.0


@dataclass(frozen=True)
class ModelSettings:
    """Which model runs where: the checkpoint, the device, the ranks and the CPU threads."""

    spec: str = "default"  # --model: `default` (embedded SmolLM2), a .gguf or a HF directory
    device: str = "cpu"  # --device: cpu, cuda or xla
    tensor_parallel_size: int = 1  # --tensor-parallel-size: ranks the model is sharded over
    tensor_parallel_timeout_s: float = 120.0  # --tensor-parallel-timeout-s: rendezvous, collectives
    threads: int = 0  # --threads: torch's CPU threads (0: torch's default, capped by the container)
    adaptive_threads: bool = True  # --adaptive-threads: the thread governor on CPU


@dataclass(frozen=True)
class PromptLimits:
    """What the servicer refuses before a request reaches the engine."""

    max_prompt_tokens: int = 0  # --max-prompt-tokens (0: the context less one, `prompt_tokens`)
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # --max-prompt-bytes, before tokenizing
    tokenizer_threads: int = 2  # --tokenizer-threads: prompts tokenized at once

    def prompt_tokens(self, engine: EngineConfig) -> int:
        """The longest prompt the engine takes: the flag, or the context less one."""
        return self.max_prompt_tokens or engine.max_seq_len - 1


@dataclass(frozen=True)
class GrammarSettings:
    """The grammar client: where the replicas are, how long to wait for them, TLS to them."""

    targets: str = ""  # --grammar-service: HOST:PORT[,...] or dns:///NAME:PORT
    dns_refresh_s: float = DEFAULT_REFRESH_S  # --grammar-dns-refresh-s
    step_timeout_s: float = 5.0  # --grammar-timeout-s: deadline of one step's answers
    open_timeout_s: float = 30.0  # --grammar-open-timeout-s: deadline of an Open (compile)
    compact_masks: bool = True  # --grammar-compact-masks
    poison_after: int = 2  # --grammar-poison-after: replica deaths before a request is poison
    tls: ClientTLS | None = None  # --grammar-tls*: None is plaintext


@dataclass(frozen=True)
class WorkerConfig:
    """Everything `maskwire worker` flags decide, checked and resolved."""

    server: ServerConfig
    model: ModelSettings
    tuning: Tuning  # the speed settings the flags resolve to (dtype, compile, quantize, ...)
    # The engine as the flags give it; `fit_context` fits it to the model's context.
    engine: EngineConfig
    prompts: PromptLimits
    grammar: GrammarSettings | None  # None: structured outputs disabled


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The flags (`neuron_worker.cli.add_arguments`) checked and resolved; raises `ConfigError`
    naming the flag to change. Imports torch (the speed settings probe the device)."""
    from neuron_worker.tuning import resolve

    model = _model_settings(args)
    tuning = resolve(
        device=model.device,
        spec=model.spec,
        dtype=args.dtype,
        compile=args.compile,
        quantize=args.quantize,
        warmup=args.warmup,
        compile_cache=args.compile_cache,
        overlap=args.overlap,
        speculative=args.speculative,
        tensor_parallel=model.tensor_parallel_size,
        cuda_graphs=args.cuda_graphs,
    )
    return WorkerConfig(
        server=server_config(args),
        model=model,
        tuning=tuning,
        engine=_engine_config(args, overlap=tuning.overlap, speculative=tuning.speculative),
        prompts=_prompt_limits(args),
        grammar=_grammar_settings(args) if args.structured_outputs else None,
    )


def fit_context(engine: EngineConfig, model_max_seq: int) -> EngineConfig:
    """`engine` with its context capped at the model's (a warning when the flag asked for more),
    and the sequence and token buckets capped with it."""
    if engine.max_seq_len <= model_max_seq:
        return engine
    log.warning(
        "--max-seq-len %d exceeds the model's %d; using %d",
        engine.max_seq_len,
        model_max_seq,
        model_max_seq,
    )
    return dataclasses.replace(
        engine,
        max_seq_len=model_max_seq,
        seq_buckets=_capped(engine.seq_buckets, model_max_seq),
        token_buckets=_capped(engine.token_buckets, model_max_seq) if engine.token_buckets else (),
    )


def _capped(buckets: tuple[int, ...], hi: int) -> tuple[int, ...]:
    # `parse_buckets`' rule: the buckets below `hi`, and `hi` itself.
    return tuple(sorted({b for b in buckets if b < hi} | {hi}))


def _at_least(flag: str, value: float, low: float, note: str = "") -> None:
    if value < low:
        raise ConfigError(f"{flag} must be >= {low:g}{note}, not {value:g}")


def _positive(flag: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{flag} must be > 0, not {value:g}")


def _model_settings(args: argparse.Namespace) -> ModelSettings:
    _at_least("--tensor-parallel-size", args.tensor_parallel_size, 1)
    _positive("--tensor-parallel-timeout-s", args.tensor_parallel_timeout_s)
    _at_least("--threads", args.threads, 0, " (0: torch's default)")
    return ModelSettings(
        spec=args.model,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_timeout_s=args.tensor_parallel_timeout_s,
        threads=args.threads,
        adaptive_threads=args.adaptive_threads,
    )


def _buckets(flag: str, text: str, hi: int, lo: int) -> list[int]:
    from neuron_worker.scheduler import parse_buckets

    try:
        return parse_buckets(text, hi, lo)
    except ValueError as e:
        raise ConfigError(f"{flag}: comma-separated positive integers, not {text!r} ({e})") from e


def _engine_config(args: argparse.Namespace, *, overlap: bool, speculative: str) -> EngineConfig:
    from neuron_worker.graphs import MAX_FLAT_TOKENS
    from neuron_worker.scheduler import pow2_buckets

    _at_least("--max-batch-size", args.max_batch_size, 1)
    _at_least("--max-seq-len", args.max_seq_len, 2)
    _at_least("--max-queue", args.max_queue, 0)
    _at_least("--max-prefill-tokens", args.max_prefill_tokens, 0)
    _at_least("--prefix-cache-slots", args.prefix_cache_slots, 0)
    _at_least("--prefix-refresh-tokens", args.prefix_refresh_tokens, 0, " (0: never)")
    _at_least("--prefix-refresh-idle-ms", args.prefix_refresh_idle_ms, 0)
    _at_least("--admit-window-ms", args.admit_window_ms, 0, " (0: admit at once)")
    _at_least("--admit-quiet-ms", args.admit_quiet_ms, 0)
    _at_least("--stream-interval-ms", args.stream_interval_ms, 0, " (0: after every step)")
    if not -1 <= args.flat_pass_tokens <= MAX_FLAT_TOKENS:
        raise ConfigError(
            f"--flat-pass-tokens must be -1 (auto) or 0..{MAX_FLAT_TOKENS}, "
            f"not {args.flat_pass_tokens}"
        )
    if args.verify_pass_tokens < -1:
        raise ConfigError(
            "--verify-pass-tokens must be -1 (auto), 0 (no limit) or more, "
            f"not {args.verify_pass_tokens}"
        )
    max_seq = args.max_seq_len
    return EngineConfig(
        max_batch=args.max_batch_size,
        max_seq_len=max_seq,
        max_queue=args.max_queue,
        batch_buckets=tuple(
            _buckets("--batch-buckets", args.batch_buckets, args.max_batch_size, 1)
        ),
        seq_buckets=tuple(
            _buckets("--seq-buckets", args.seq_buckets, max_seq, 128)
            if args.seq_buckets.strip()
            else pow2_buckets(min(128, max_seq), max_seq)
        ),
        max_prefill_tokens=args.max_prefill_tokens,
        admit_window_s=args.admit_window_ms / 1e3,
        admit_quiet_s=args.admit_quiet_ms / 1e3,
        stream_interval_s=args.stream_interval_ms / 1e3,
        flat_tokens=None if args.flat_pass_tokens < 0 else args.flat_pass_tokens,
        # () is 1, 2, 4, ..., max_seq_len; a decode step is one token per row: 1 is always one.
        token_buckets=tuple(
            sorted({1, *_buckets("--token-buckets", args.token_buckets, max_seq, 1)})
        )
        if args.token_buckets.strip()
        else (),
        # XLA pads every dimension to the buckets (one graph per bucket); elsewhere the shapes
        # are dynamic.
        bucketed=args.device == "xla",
        structured_outputs=args.structured_outputs,
        prefix_cache=args.prefix_cache,
        prefix_cache_slots=args.prefix_cache_slots,
        prefix_refresh_tokens=args.prefix_refresh_tokens,
        prefix_refresh_idle_s=args.prefix_refresh_idle_ms / 1e3,
        overlap=overlap,
        jump_forward=args.jump_forward,
        fused_decode=args.fused_decode,
        greedy_kernel=args.greedy_kernel,
        speculative=_draft_config(args) if speculative == "ngram" else None,
    )


def _draft_config(args: argparse.Namespace) -> DraftConfig:
    """The drafter's settings from `--speculative ngram`'s flags."""
    _at_least("--num-draft-tokens", args.num_draft_tokens, 1)
    _at_least("--forced-draft-tokens", args.forced_draft_tokens, 0)
    _at_least("--draft-pause-declines", args.draft_pause_declines, 0)
    match: DraftMatch = args.draft_match
    min_n, max_n = DEFAULT_SIZES[match]
    min_n = min_n if args.ngram_min is None else args.ngram_min
    max_n = max_n if args.ngram_max is None else args.ngram_max
    if not 1 <= min_n <= max_n:
        raise ConfigError(
            f"--ngram-min and --ngram-max must satisfy 1 <= min <= max (with --draft-match "
            f"{match}: {min_n} and {max_n})"
        )
    return DraftConfig(
        num_draft_tokens=args.num_draft_tokens,
        forced_drafts=args.forced_draft_tokens,
        match=match,
        min_n=min_n,
        max_n=max_n,
        pass_tokens=_verify_pass_tokens(args),
        gate=args.speculation_gate,
        pause_declines=args.draft_pause_declines,
    )


def _verify_pass_tokens(args: argparse.Namespace) -> int:
    """`--verify-pass-tokens`, with its default resolved: on a CPU, the max batch size (a
    verification pass runs flat through the 4-bit kernel, which reads the weights once per 8
    rows: at c8, more drafts than that cost more than they save); elsewhere no limit."""
    if args.verify_pass_tokens >= 0:
        return int(args.verify_pass_tokens)
    return int(args.max_batch_size) if args.device == "cpu" else 0


def _prompt_limits(args: argparse.Namespace) -> PromptLimits:
    _at_least("--max-prompt-tokens", args.max_prompt_tokens, 0, " (0: --max-seq-len - 1)")
    _at_least("--max-prompt-bytes", args.max_prompt_bytes, 1)
    _at_least("--tokenizer-threads", args.tokenizer_threads, 1)
    return PromptLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_prompt_bytes=args.max_prompt_bytes,
        tokenizer_threads=args.tokenizer_threads,
    )


def _grammar_settings(args: argparse.Namespace) -> GrammarSettings:
    if not args.grammar_service:
        raise ConfigError(
            "--grammar-service HOST:PORT is required with structured outputs enabled "
            "(or pass --disable-structured-outputs)"
        )
    try:
        parse_targets(args.grammar_service)
    except TargetError as e:
        raise ConfigError(f"--grammar-service: {e}") from e
    _positive("--grammar-dns-refresh-s", args.grammar_dns_refresh_s)
    _positive("--grammar-timeout-s", args.grammar_timeout_s)
    _positive("--grammar-open-timeout-s", args.grammar_open_timeout_s)
    _at_least("--grammar-poison-after", args.grammar_poison_after, 1)
    return GrammarSettings(
        targets=args.grammar_service,
        dns_refresh_s=args.grammar_dns_refresh_s,
        step_timeout_s=args.grammar_timeout_s,
        open_timeout_s=args.grammar_open_timeout_s,
        compact_masks=args.grammar_compact_masks,
        poison_after=args.grammar_poison_after,
        tls=client_tls_from_args(args, "grammar"),
    )
