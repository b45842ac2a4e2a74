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
        "--max-schema-bytes", type=int, default=1 << 20, help="largest constraint text (bytes)"
    )
    p.add_argument("--compile-timeout-s", type=float, default=10.0, help="deadline per compile")
    p.add_argument("--compile-cache-size", type=int, default=1024, help="compiled grammars kept")
    p.add_argument("--compile-threads", type=int, default=2, help="compile thread pool size")
    p.add_argument(
        "--mask-threads",
        type=int,
        default=0,
        help="llguidance executor threads for batched mask fill (0: every CPU this process may "
        "use; llguidance's own default is 80%% of them)",
    )
    p.add_argument("--max-rows-per-step", type=int, default=4096, help="rows in one Step")
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
    try:
        credentials = server_credentials_from_args(args)
    except TLSConfigError as e:
        print(f"maskwire grammar-service: {e}", file=sys.stderr)
        return 2
    return event_loop.run(main(args, credentials), args.event_loop)
