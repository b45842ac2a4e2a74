"""`maskwire grammar-service`: flags and startup (heavy imports happen inside `run`)."""

from __future__ import annotations

import argparse
import sys

from grammar_service.config import (
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_PORT,
    SCHEMA_MODES,
    CompileSettings,
    ConstraintBounds,
    Limits,
    ParserLimits,
    ProcessSettings,
    SandboxConfig,
)
from maskwire.server_args import add_grpc_server_arguments

# Every default is the configuration's (`grammar_service.config`): defined there, once.
COMPILE = CompileSettings()
SANDBOX = SandboxConfig()
LIMITS = Limits()
BOUNDS = ConstraintBounds()
PARSER = ParserLimits()
PROCESS = ProcessSettings()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every grammar-service flag, grouped by concern (`--help` lists them by group)."""
    add_grpc_server_arguments(p, port=DEFAULT_PORT, drain_grace_s=DEFAULT_DRAIN_GRACE_S)
    _compile_flags(p)
    _sandbox_flags(p)
    _bounds_flags(p)
    _limit_flags(p)
    _process_flags(p)
    _parser_flags(p)


def _compile_flags(p: argparse.ArgumentParser) -> None:
    """The tokenizers served and the compiler: size, deadline, schema mode, cache, threads."""
    g = p.add_argument_group("tokenizers and the compiler")
    g.add_argument(
        "--tokenizer",
        action="append",
        metavar="SPEC",
        help="tokenizer to serve: `default` (embedded SmolLM2), a .gguf, a tokenizer.json, a HF "
        "directory or a Mistral Tekken json; repeatable (requests pick one by fingerprint). "
        "Default: `default`",
    )
    g.add_argument(
        "--max-schema-bytes",
        type=int,
        default=COMPILE.max_schema_bytes,
        help="largest constraint: its text and every option string together (bytes)",
    )
    g.add_argument(
        "--compile-timeout-s",
        type=float,
        default=COMPILE.timeout_s,
        help="deadline per compile",
    )
    g.add_argument(
        "--schema-mode",
        choices=SCHEMA_MODES,
        default=COMPILE.schema_mode,
        help="JSON schema keywords llguidance cannot enforce as written: `complete` rewrites, "
        "annotates or checks them on the output (every finished output is validated against the "
        "schema); `strict` refuses such schemas. Requests may choose with "
        "JsonOptions.schema_mode",
    )
    g.add_argument(
        "--compile-cache-size",
        type=int,
        default=COMPILE.cache_size,
        help="compiled grammars kept",
    )
    g.add_argument(
        "--compile-cache-bytes",
        type=int,
        default=COMPILE.cache_bytes,
        help="estimated memory of the compiled grammars kept (bytes; each is charged 160 KiB + "
        "200 bytes per byte of its grammar text); least recently used ones go first",
    )
    g.add_argument(
        "--compile-threads",
        type=int,
        default=COMPILE.threads,
        help="threads that translate constraints and build matchers in this process",
    )


def _sandbox_flags(p: argparse.ArgumentParser) -> None:
    """The compile sandbox's children, the poison list and the threads' stacks."""
    g = p.add_argument_group(
        "compile sandbox (child processes that run the grammar compiler on untrusted grammars)"
    )
    g.add_argument(
        "--compile-sandbox",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="verify every new grammar in a child process first, so a grammar that crashes or "
        "runs away kills a child, not this service (default on; off only for debugging)",
    )
    g.add_argument(
        "--compile-workers", type=int, default=SANDBOX.workers, help="sandbox child processes"
    )
    g.add_argument(
        "--compile-memory-mb",
        type=int,
        default=SANDBOX.memory_mb,
        help="address-space limit of one sandbox child (MiB; 0: none)",
    )
    g.add_argument(
        "--compile-stack-mb",
        type=int,
        default=SANDBOX.stack_mb,
        help="stack of the thread that compiles in a sandbox child (MiB)",
    )
    g.add_argument(
        "--compile-large-bytes",
        type=int,
        default=SANDBOX.large_bytes,
        help="grammars larger than this may occupy at most all but one sandbox child, so small "
        "grammars never queue behind big ones",
    )
    g.add_argument(
        "--state-dir",
        default="",
        help="directory that keeps the poison list (constraints that crashed this service) "
        "across restarts (default: $XDG_STATE_HOME/maskwire/grammar-service-PORT)",
    )
    g.add_argument(
        "--poison-ttl-s",
        type=float,
        default=COMPILE.poison_ttl_s,
        help="how long a constraint that crashed this service stays refused",
    )
    g.add_argument(
        "--thread-stack-mb",
        type=int,
        default=PROCESS.thread_stack_mb,
        help="stack of this service's threads (MiB): llguidance recurses over a grammar's "
        "structure natively",
    )


def _bounds_flags(p: argparse.ArgumentParser) -> None:
    """Limits on a constraint's shape (`grammar_service.bounds`)."""
    g = p.add_argument_group("constraint shape (checked before compiling)")
    g.add_argument(
        "--max-schema-depth",
        type=int,
        default=BOUNDS.max_schema_depth,
        help="longest chain of nested subschemas in a JSON schema, counting $ref hops",
    )
    g.add_argument(
        "--max-schema-nodes",
        type=int,
        default=BOUNDS.max_schema_nodes,
        help="objects and arrays in one schema",
    )
    g.add_argument(
        "--max-grammar-depth",
        type=int,
        default=BOUNDS.max_grammar_depth,
        help="longest chain of rule references in a Lark/GBNF grammar",
    )
    g.add_argument(
        "--max-grammar-rules",
        type=int,
        default=BOUNDS.max_grammar_rules,
        help="rules in one Lark/GBNF grammar",
    )
    g.add_argument(
        "--max-choices", type=int, default=BOUNDS.max_choices, help="alternatives of a choice"
    )


def _limit_flags(p: argparse.ArgumentParser) -> None:
    """Service-wide limits on requests, steps and messages."""
    g = p.add_argument_group("requests and steps")
    g.add_argument(
        "--max-requests",
        type=int,
        default=LIMITS.max_requests,
        help="live requests, all streams",
    )
    g.add_argument(
        "--max-requests-per-stream",
        type=int,
        default=LIMITS.max_requests_per_stream,
        help="live requests one Session stream may hold, so one client cannot take every slot "
        "(keep it at least the workers' --max-batch-size + --max-queue: a worker keeps one "
        "stream per replica)",
    )
    g.add_argument(
        "--max-rows-per-step",
        type=int,
        default=LIMITS.max_rows_per_step,
        help="rows in one Step",
    )
    g.add_argument(
        "--max-request-step-ms",
        type=float,
        default=LIMITS.max_request_step_s * 1e3,
        help="CPU time one request's grammar work may take in one step; past it the request "
        "fails (GRAMMAR_TOO_EXPENSIVE) so the others on its stream keep their step times",
    )
    g.add_argument(
        "--max-replay-ms",
        type=float,
        default=LIMITS.max_replay_s * 1e3,
        help="CPU time replaying one request's tokens (Open.replay_tokens) may take",
    )
    g.add_argument(
        "--max-drafts-per-row",
        type=int,
        default=LIMITS.max_drafts_per_row,
        help="draft tokens per row",
    )
    g.add_argument(
        "--compact-min-rows",
        type=int,
        default=LIMITS.compact_min_rows,
        help="for clients that accept compact masks (Step.compact_masks): encode a step's mask "
        "rows compactly from this many rows (smaller steps go dense: on loopback their bytes "
        "cost less than encoding and decoding them)",
    )
    g.add_argument(
        "--max-message-bytes",
        type=int,
        default=PROCESS.max_message_bytes,
        help="gRPC message size limit",
    )


def _process_flags(p: argparse.ArgumentParser) -> None:
    """The mask-fill threads, and the test-only fault hook."""
    g = p.add_argument_group("process")
    g.add_argument(
        "--mask-threads",
        type=int,
        default=PROCESS.mask_threads,
        help="llguidance executor threads for batched mask fill (0: every CPU this process may "
        "use; llguidance's own default is 80%% of them)",
    )
    g.add_argument(
        "--testing-faults",
        action="store_true",
        help="TEST ONLY, never in production: arm the fault hook of $MASKWIRE_TESTING_FAULT "
        "(grammars containing its markers abort or hang the service or a compile worker); "
        "without this flag the variable does nothing",
    )


def _parser_flags(p: argparse.ArgumentParser) -> None:
    """llguidance's parser limits (`llguidance.LLParserLimits`)."""
    g = p.add_argument_group("llguidance parser limits")
    g.add_argument("--max-items-in-row", type=int, default=PARSER.max_items_in_row)
    g.add_argument("--initial-lexer-fuel", type=int, default=PARSER.initial_lexer_fuel)
    g.add_argument("--step-lexer-fuel", type=int, default=PARSER.step_lexer_fuel)
    g.add_argument("--step-max-items", type=int, default=PARSER.step_max_items)
    g.add_argument("--max-lexer-states", type=int, default=PARSER.max_lexer_states)
    g.add_argument("--max-grammar-size", type=int, default=PARSER.max_grammar_size)


def run(args: argparse.Namespace) -> int:
    from grammar_service.config import service_config
    from grammar_service.server import main
    from maskwire import event_loop
    from maskwire.config import ConfigError
    from maskwire.logs import setup_logging

    setup_logging(args.log_level)
    try:
        config = service_config(args)
    except ConfigError as e:
        print(f"maskwire grammar-service: {e}", file=sys.stderr)
        return 2
    return event_loop.run(main(config), config.server.event_loop)
