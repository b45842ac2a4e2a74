"""`maskwire gateway`: the OpenAI-compatible REST front (kept light: FastAPI loads in `run`)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from gateway.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES
from maskwire.discovery import add_refresh_argument
from maskwire.tls import TLSConfigError, add_client_tls_arguments, client_tls_from_args

# The names of `gateway.tool_formats.FORMATS`, spelled out to keep this module light.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="worker gRPC address; repeat the flag or give a comma list for several; "
        "dns:///NAME:PORT means every address behind NAME (followed as it changes)",
    )
    add_refresh_argument(parser, "--worker-dns-refresh-s")
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template to use instead of the model's own",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls (default: what its chat template asks for; "
        "hermes for templates without tool support)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="deadline of one request on the worker, seconds (default 600; 504 past it)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body accepted (default 8 MiB; 413 past it)",
    )
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=DEFAULT_MAX_PROMPT_BYTES,
        help="largest prompt text (the rendered chat or the completions prompt) sent to a "
        "worker, in UTF-8 bytes (default 1 MiB; 400 past it)",
    )
    parser.add_argument(
        "--max-json-depth",
        type=int,
        default=DEFAULT_MAX_JSON_DEPTH,
        help="deepest nesting of a request body, and of JSON sent as text in a field (a schema, "
        "tool-call arguments) (default 64; 400 past it)",
    )
    parser.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"most choices (`n`) per request (default {DEFAULT_MAX_N}; 400 past it; also "
        "capped by the worker's max batch size)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        help="generation requests handled at once; more get 429 (default 256)",
    )
    parser.add_argument(
        "--health-interval-s",
        type=float,
        default=5.0,
        help="seconds between worker health checks (default 5)",
    )
    parser.add_argument(
        "--health-timeout-s",
        type=float,
        default=2.0,
        help="a worker that does not answer its health check within this is marked down "
        "(default 2)",
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING...")
    keys = parser.add_argument_group(
        "API keys (with any key configured, /v1/* needs `Authorization: Bearer KEY`; "
        "/health, /ready and /metrics stay open)"
    )
    keys.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accepted key (repeatable; visible in `ps`: prefer --api-key-file or the "
        "MASKWIRE_API_KEYS environment variable, comma separated)",
    )
    keys.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="FILE",
        help="file with one key per line (# comments allowed); repeatable",
    )
    keys.add_argument(
        "--max-concurrency-per-key",
        type=int,
        default=64,
        help="choices in flight per API key (a POST /v1 request with `n` choices counts n); more "
        "get 429 (default 64; 0: no cap)",
    )
    add_client_tls_arguments(parser, "worker", "the workers")


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from gateway.app import GatewayConfig, create_app
    from gateway.auth import KeyConfigError, load_keys
    from gateway.workers import parse_addresses
    from maskwire.discovery import TargetError, parse_targets
    from maskwire.logs import setup_logging

    setup_logging(args.log_level)
    for name in (
        "max_body_bytes",
        "max_concurrency",
        "max_prompt_bytes",
        "max_json_depth",
        "max_n",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.request_timeout_s, args.health_interval_s, args.health_timeout_s) <= 0:
        raise SystemExit(
            "--request-timeout-s, --health-interval-s and --health-timeout-s must be positive"
        )
    if args.max_concurrency_per_key < 0:
        raise SystemExit("--max-concurrency-per-key must be 0 (no cap) or more")
    try:
        api_keys = load_keys(args.api_key, args.api_key_file)
        worker_tls = client_tls_from_args(args, "worker")
    except (KeyConfigError, TLSConfigError) as e:
        raise SystemExit(f"maskwire gateway: {e}") from e
    template = None
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise SystemExit(f"--chat-template: no such file: {path}")
        template = path.read_text()
        from gateway.chat_template import ChatTemplate, TemplateError

        try:
            ChatTemplate(template)
        except TemplateError as e:
            raise SystemExit(f"--chat-template {path}: {e}") from e
    workers = parse_addresses(args.worker)
    try:
        parse_targets(workers)
    except TargetError as e:
        raise SystemExit(f"--worker: {e}") from e
    config = GatewayConfig(
        workers=workers,
        worker_dns_refresh_s=args.worker_dns_refresh_s,
        chat_template=template,
        tool_call_parser=args.tool_call_parser,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        max_concurrency=args.max_concurrency,
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        max_prompt_bytes=args.max_prompt_bytes,
        max_json_depth=args.max_json_depth,
        max_n=args.max_n,
        api_keys=tuple(api_keys),
        max_concurrency_per_key=args.max_concurrency_per_key,
        worker_tls=worker_tls,
    )
    logging.getLogger("gateway").info(
        "API keys: %s; to the workers: %s",
        f"{len(api_keys)} configured" if api_keys else "none (the API is open)",
        "plaintext" if worker_tls is None else "mutual TLS" if args.worker_tls_cert else "TLS",
    )
    app = create_app(config)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler it found, so the
    # process would die of it (status -15). Exit 0 instead, like the gRPC services after a drain.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_after_drain)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=(args.log_level or "info").lower(),
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def _exit_after_drain(signum: int, frame: object) -> None:
    raise SystemExit(0)
