"""`maskwire grammar-service`: flags and startup (heavy imports happen inside `run`)."""

from __future__ import annotations

import argparse
import sys

from maskwire.server_args import add_grpc_server_arguments
from maskwire.tls import TLSConfigError, server_credentials_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_grpc_server_arguments(p, port=50061, drain_grace_s=5.0)
    p.add_argument(
        "--tokenizer",
        action="append",
        metavar="SPEC",
        help="tokenizer to serve: `default` (embedded SmolLM2), a .gguf, a tokenizer.json, a HF "
        "directory or a Mistral Tekken json; repeatable (requests pick one by fingerprint). "
        "Default: `default`",
    )
    p.add_argument("--max-requests", type=int, default=4096, help="live requests, all streams")
    p.add_argument(
        "--max-requests-per-stream",
        type=int,
        default=1024,
        help="live requests one Session stream may hold, so one client cannot take every slot "
        "(keep it at least the workers' --max-batch-size + --max-queue: a worker keeps one "
        "stream per replica)",
    )
    p.add_argument(
        "--max-schema-bytes",
        type=int,
        default=1 << 20,
        help="largest constraint: its text and every option string together (bytes)",
    )
    p.add_argument("--compile-timeout-s", type=float, default=10.0, help="deadline per compile")
    p.add_argument(
        "--schema-mode",
        choices=("complete", "strict"),
        default="complete",
        help="JSON schema keywords llguidance cannot enforce as written: `complete` rewrites, "
        "annotates or checks them on the output (every finished output is validated against the "
        "schema); `strict` refuses such schemas. Requests may choose with "
        "JsonOptions.schema_mode",
    )
    p.add_argument("--compile-cache-size", type=int, default=1024, help="compiled grammars kept")
    p.add_argument(
        "--compile-cache-bytes",
        type=int,
        default=512 << 20,
        help="estimated memory of the compiled grammars kept (bytes; each is charged 160 KiB + "
        "200 bytes per byte of its grammar text); least recently used ones go first",
    )
    p.add_argument(
        "--compile-threads",
        type=int,
        default=2,
        help="threads that translate constraints and build matchers in this process",
    )
    sb = p.add_argument_group(
        "compile sandbox (child processes that run the grammar compiler on untrusted grammars)"
    )
    sb.add_argument(
        "--compile-sandbox",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="verify every new grammar in a child process first, so a grammar that crashes or "
        "runs away kills a child, not this service (default on; off only for debugging)",
    )
    sb.add_argument("--compile-workers", type=int, default=2, help="sandbox child processes")
    sb.add_argument(
        "--compile-memory-mb",
        type=int,
        default=4096,
        help="address-space limit of one sandbox child (MiB; 0: none)",
    )
    sb.add_argument(
        "--compile-stack-mb",
        type=int,
        default=256,
        help="stack of the thread that compiles in a sandbox child (MiB)",
    )
    sb.add_argument(
        "--compile-large-bytes",
        type=int,
        default=64 << 10,
        help="grammars larger than this may occupy at most all but one sandbox child, so small "
        "grammars never queue behind big ones",
    )
    sb.add_argument(
        "--state-dir",
        default="",
        help="directory that keeps the poison list (constraints that crashed this service) "
        "across restarts (default: $XDG_STATE_HOME/maskwire/grammar-service-PORT)",
    )
    sb.add_argument(
        "--poison-ttl-s",
        type=float,
        default=3600.0,
        help="how long a constraint that crashed this service stays refused",
    )
    sb.add_argument(
        "--thread-stack-mb",
        type=int,
        default=256,
        help="stack of this service's threads (MiB): llguidance recurses over a grammar's "
        "structure natively",
    )
    b = p.add_argument_group("constraint shape (checked before compiling)")
    b.add_argument(
        "--max-schema-depth",
        type=int,
        default=256,
        help="longest chain of nested subschemas in a JSON schema, counting $ref hops",
    )
    b.add_argument(
        "--max-schema-nodes", type=int, default=200_000, help="objects and arrays in one schema"
    )
    b.add_argument(
        "--max-grammar-depth",
        type=int,
        default=256,
        help="longest chain of rule references in a Lark/GBNF grammar",
    )
    b.add_argument(
        "--max-grammar-rules", type=int, default=20_000, help="rules in one Lark/GBNF grammar"
    )
    b.add_argument("--max-choices", type=int, default=200_000, help="alternatives of a choice")
    p.add_argument(
        "--mask-threads",
        type=int,
        default=0,
        help="llguidance executor threads for batched mask fill (0: every CPU this process may "
        "use; llguidance's own default is 80%% of them)",
    )
    p.add_argument("--max-rows-per-step", type=int, default=4096, help="rows in one Step")
    p.add_argument(
        "--max-request-step-ms",
        type=float,
        default=20.0,
        help="CPU time one request's grammar work may take in one step; past it the request "
        "fails (GRAMMAR_TOO_EXPENSIVE) so the others on its stream keep their step times",
    )
    p.add_argument(
        "--max-replay-ms",
        type=float,
        default=2000.0,
        help="CPU time replaying one request's tokens (Open.replay_tokens) may take",
    )
    p.add_argument("--max-drafts-per-row", type=int, default=64, help="draft tokens per row")
    p.add_argument(
        "--compact-min-rows",
        type=int,
        default=16,
        help="for clients that accept compact masks (Step.compact_masks): encode a step's mask "
        "rows compactly from this many rows (smaller steps go dense: on loopback their bytes "
        "cost less than encoding and decoding them)",
    )
    p.add_argument(
        "--max-message-bytes", type=int, default=64 * 1024 * 1024, help="gRPC message size limit"
    )
    p.add_argument(
        "--testing-faults",
        action="store_true",
        help="TEST ONLY, never in production: arm the fault hook of $MASKWIRE_TESTING_FAULT "
        "(grammars containing its markers abort or hang the service or a compile worker); "
        "without this flag the variable does nothing",
    )
    g = p.add_argument_group("llguidance parser limits")
    g.add_argument("--max-items-in-row", type=int, default=2000)
    g.add_argument("--initial-lexer-fuel", type=int, default=1_000_000)
    g.add_argument("--step-lexer-fuel", type=int, default=200_000)
    g.add_argument("--step-max-items", type=int, default=50_000)
    g.add_argument("--max-lexer-states", type=int, default=250_000)
    g.add_argument("--max-grammar-size", type=int, default=500_000)


def run(args: argparse.Namespace) -> int:
    from grammar_service.server import main
    from maskwire import event_loop
    from maskwire.logs import setup_logging

    setup_logging(args.log_level)
    if args.max_requests_per_stream < 1:
        print(
            "maskwire grammar-service: --max-requests-per-stream must be 1 or more", file=sys.stderr
        )
        return 2
    try:
        credentials = server_credentials_from_args(args)
    except TLSConfigError as e:
        print(f"maskwire grammar-service: {e}", file=sys.stderr)
        return 2
    return event_loop.run(main(args, credentials), args.event_loop)
