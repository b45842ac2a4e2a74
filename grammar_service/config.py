"""The grammar service's configuration: one frozen `ServiceConfig`, built from the flags and
checked in one place (`service_config`), then passed down whole.

Each setting's default is defined once, on its dataclass field here;
the flags (`grammar_service.cli`) read their defaults from those fields. This module stays light:
the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

from maskwire.config import ConfigError
from maskwire.server_args import ServerConfig, server_config

N = TypeVar("N", int, float)

DEFAULT_PORT = 50061
DEFAULT_DRAIN_GRACE_S = 5.0
SCHEMA_MODES = ("complete", "strict")


@dataclass(frozen=True)
class ParserLimits:
    """llguidance parser limits (see `llguidance.LLParserLimits`); flags of the CLI."""

    max_items_in_row: int = 2000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000


@dataclass(frozen=True)
class ConstraintBounds:
    """Limits on a constraint's shape, checked before compiling (`grammar_service.bounds`)."""

    # Longest chain of nested subschemas, following local `$ref`s (`--max-schema-depth`).
    max_schema_depth: int = 256
    # Objects and arrays in one JSON schema (`--max-schema-nodes`).
    max_schema_nodes: int = 200_000
    # Longest chain of rule references in a Lark/GBNF grammar (`--max-grammar-depth`).
    max_grammar_depth: int = 256
    # Rule and terminal definitions in one Lark/GBNF grammar (`--max-grammar-rules`).
    max_grammar_rules: int = 20_000
    # Alternatives of a `choice` constraint (`--max-choices`).
    max_choices: int = 200_000


@dataclass(frozen=True)
class SandboxConfig:
    """Sizing of the compile sandbox (`grammar_service.sandbox`)."""

    workers: int = 2  # --compile-workers
    memory_mb: int = 4096  # --compile-memory-mb: address-space limit of one child
    stack_mb: int = 256  # --compile-stack-mb: stack of the thread that compiles
    large_bytes: int = 64 << 10  # --compile-large-bytes: grammars above this use the large lane
    testing_faults: str = ""  # the test-only fault hook's specs the children arm (--testing-faults)


@dataclass(frozen=True)
class Limits:
    """Service-wide limits on requests and steps (`grammar_service.runtime`)."""

    max_requests: int = 4096  # --max-requests
    # Live requests one Session stream may hold, so one client cannot take every slot. A worker
    # keeps one stream per replica for all its requests: at least its batch + queue (264).
    max_requests_per_stream: int = 1024  # --max-requests-per-stream
    max_rows_per_step: int = 4096  # --max-rows-per-step
    max_drafts_per_row: int = 64  # --max-drafts-per-row
    # Steps with fewer mask rows are answered dense even when the client accepts compact rows.
    compact_min_rows: int = 16  # --compact-min-rows
    # CPU time one request's grammar work may take in one step, and in one replay (seconds).
    max_request_step_s: float = 0.02  # --max-request-step-ms
    max_replay_s: float = 2.0  # --max-replay-ms


@dataclass(frozen=True)
class CompileSettings:
    """The compiler (`grammar_service.compile_pool`), its cache and its poison list."""

    threads: int = 2  # --compile-threads: translate constraints and build matchers
    timeout_s: float = 10.0  # --compile-timeout-s: deadline per compile
    max_schema_bytes: int = 1 << 20  # --max-schema-bytes: a constraint's text and options
    schema_mode: str = "complete"  # --schema-mode: complete or strict
    cache_size: int = 1024  # --compile-cache-size: compiled grammars kept
    cache_bytes: int = 512 << 20  # --compile-cache-bytes: their estimated memory
    poison_ttl_s: float = 3600.0  # --poison-ttl-s: how long a crashing constraint is refused
    # --state-dir: where the poison list survives restarts (None: memory only).
    state_dir: Path | None = None


@dataclass(frozen=True)
class ProcessSettings:
    """How the service process runs its threads and messages."""

    mask_threads: int = 0  # --mask-threads: llguidance's mask fill (0: every usable CPU)
    thread_stack_mb: int = 256  # --thread-stack-mb: llguidance recurses natively
    max_message_bytes: int = 64 * 1024 * 1024  # --max-message-bytes: gRPC message size limit
    testing_faults: bool = False  # --testing-faults: TEST ONLY, arms $MASKWIRE_TESTING_FAULT


@dataclass(frozen=True)
class ServiceConfig:
    """Everything `maskwire grammar-service` flags decide, checked and resolved."""

    server: ServerConfig
    tokenizers: tuple[str, ...]  # --tokenizer SPECs, in order
    parser_limits: ParserLimits
    bounds: ConstraintBounds
    compile: CompileSettings
    sandbox: SandboxConfig | None  # None: --no-compile-sandbox (verify in this process)
    limits: Limits
    process: ProcessSettings


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The flags (`grammar_service.cli.add_arguments`) checked and resolved; raises `ConfigError`
    naming the flag to change."""
    # These flags are named as their fields are.
    parser_limits = ParserLimits(
        **{f.name: _at_least(f.name, getattr(args, f.name), 1) for f in fields(ParserLimits)}
    )
    bounds = ConstraintBounds(
        **{f.name: _at_least(f.name, getattr(args, f.name), 1) for f in fields(ConstraintBounds)}
    )
    compile = CompileSettings(
        threads=_at_least("compile_threads", args.compile_threads, 1),
        timeout_s=_positive("compile_timeout_s", args.compile_timeout_s),
        max_schema_bytes=_at_least("max_schema_bytes", args.max_schema_bytes, 1),
        schema_mode=args.schema_mode,
        cache_size=_at_least("compile_cache_size", args.compile_cache_size, 0),
        cache_bytes=_at_least("compile_cache_bytes", args.compile_cache_bytes, 0),
        poison_ttl_s=_at_least("poison_ttl_s", args.poison_ttl_s, 0),
        state_dir=_state_dir(args.state_dir, args.port),
    )
    sandbox = None
    if args.compile_sandbox:
        sandbox = SandboxConfig(
            workers=_at_least("compile_workers", args.compile_workers, 1),
            memory_mb=_at_least("compile_memory_mb", args.compile_memory_mb, 0),
            stack_mb=_at_least("compile_stack_mb", args.compile_stack_mb, 1),
            large_bytes=_at_least("compile_large_bytes", args.compile_large_bytes, 0),
        )
    limits = Limits(
        max_requests=_at_least("max_requests", args.max_requests, 1),
        max_requests_per_stream=_at_least(
            "max_requests_per_stream", args.max_requests_per_stream, 1
        ),
        max_rows_per_step=_at_least("max_rows_per_step", args.max_rows_per_step, 1),
        max_drafts_per_row=_at_least("max_drafts_per_row", args.max_drafts_per_row, 0),
        compact_min_rows=_at_least("compact_min_rows", args.compact_min_rows, 0),
        max_request_step_s=_positive("max_request_step_ms", args.max_request_step_ms) / 1e3,
        max_replay_s=_positive("max_replay_ms", args.max_replay_ms) / 1e3,
    )
    process = ProcessSettings(
        mask_threads=_at_least("mask_threads", args.mask_threads, 0),
        thread_stack_mb=_at_least("thread_stack_mb", args.thread_stack_mb, 1),
        max_message_bytes=_at_least("max_message_bytes", args.max_message_bytes, 1),
        testing_faults=args.testing_faults,
    )
    return ServiceConfig(
        server=server_config(args),
        tokenizers=tuple(args.tokenizer or ["default"]),
        parser_limits=parser_limits,
        bounds=bounds,
        compile=compile,
        sandbox=sandbox,
        limits=limits,
        process=process,
    )


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _at_least(dest: str, value: N, low: int) -> N:
    if value < low:
        raise ConfigError(f"{_flag(dest)} must be {low} or more, not {value:g}")
    return value


def _positive(dest: str, value: float) -> float:
    if value <= 0:
        raise ConfigError(f"{_flag(dest)} must be more than 0, not {value:g}")
    return value


def _state_dir(flag: str, port: int) -> Path | None:
    """Where the poison list survives restarts: --state-dir, else one directory per port under
    the user's state directory (a free port, 0, has no stable identity: memory only)."""
    if flag:
        return Path(flag)
    if not port:
        return None
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "maskwire" / f"grammar-service-{port}"
