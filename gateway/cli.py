"""`maskwire gateway`: the OpenAI-compatible REST front (kept light: FastAPI loads in `run`)."""

from __future__ import annotations

import argparse
import signal
import sys

from gateway.config import TOOL_CALL_PARSERS, GatewayConfig
from maskwire.discovery import add_refresh_argument
from maskwire.server_args import add_host_argument
from maskwire.tls import add_client_tls_arguments

# Every default is the configuration's (`gateway.config`): defined there, once.
DEFAULTS = GatewayConfig(workers=())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every gateway flag, grouped by concern (`--help` lists them by group)."""
    _server_flags(parser)
    _worker_flags(parser)
    _chat_flags(parser)
    _limit_flags(parser)
    _key_flags(parser)
    add_client_tls_arguments(parser, "worker", "the workers")


def _server_flags(p: argparse.ArgumentParser) -> None:
    """Where the gateway listens, and its logs."""
    g = p.add_argument_group("server")
    add_host_argument(g, DEFAULTS.host)
    g.add_argument(
        "--port", type=int, default=DEFAULTS.port, help=f"HTTP port (default {DEFAULTS.port})"
    )
    g.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING...")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    """The workers: where they are, their health checks and a request's deadline on them."""
    g = p.add_argument_group("workers")
    g.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="worker gRPC address; repeat the flag or give a comma list for several; "
        "dns:///NAME:PORT means every address behind NAME (followed as it changes)",
    )
    add_refresh_argument(g, "--worker-dns-refresh-s", default=DEFAULTS.worker_dns_refresh_s)
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=DEFAULTS.request_timeout_s,
        help="deadline of one request on the worker, seconds "
        f"(default {DEFAULTS.request_timeout_s:g}; 504 past it)",
    )
    g.add_argument(
        "--health-interval-s",
        type=float,
        default=DEFAULTS.health_interval_s,
        help=f"seconds between worker health checks (default {DEFAULTS.health_interval_s:g})",
    )
    g.add_argument(
        "--health-timeout-s",
        type=float,
        default=DEFAULTS.health_timeout_s,
        help="a worker that does not answer its health check within this is marked down "
        f"(default {DEFAULTS.health_timeout_s:g})",
    )


def _chat_flags(p: argparse.ArgumentParser) -> None:
    """How chat messages become a prompt and tool calls are read back."""
    g = p.add_argument_group("chat")
    g.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template to use instead of the model's own",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls (default: what its chat template asks for; "
        "hermes for templates without tool support)",
    )


def _limit_flags(p: argparse.ArgumentParser) -> None:
    """Limits on one request and on the requests handled at once."""
    g = p.add_argument_group("request limits")
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULTS.max_body_bytes,
        help="largest request body accepted "
        f"(default {DEFAULTS.max_body_bytes // 1024 // 1024} MiB; 413 past it)",
    )
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=DEFAULTS.max_prompt_bytes,
        help="largest prompt text (the rendered chat or the completions prompt) sent to a "
        f"worker, in UTF-8 bytes (default {DEFAULTS.max_prompt_bytes // 1024 // 1024} MiB; 400 "
        "past it)",
    )
    g.add_argument(
        "--max-json-depth",
        type=int,
        default=DEFAULTS.max_json_depth,
        help="deepest nesting of a request body, and of JSON sent as text in a field (a schema, "
        f"tool-call arguments) (default {DEFAULTS.max_json_depth}; 400 past it)",
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=DEFAULTS.max_n,
        help=f"most choices (`n`) per request (default {DEFAULTS.max_n}; 400 past it; also "
        "capped by the worker's max batch size)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=DEFAULTS.max_concurrency,
        help="generation requests handled at once; more get 429 "
        f"(default {DEFAULTS.max_concurrency})",
    )


def _key_flags(p: argparse.ArgumentParser) -> None:
    """API keys and the in-flight cap per key."""
    g = p.add_argument_group(
        "API keys (with any key configured, /v1/* needs `Authorization: Bearer KEY`; "
        "/health, /ready and /metrics stay open)"
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accepted key (repeatable; visible in `ps`: prefer --api-key-file or the "
        "MASKWIRE_API_KEYS environment variable, comma separated)",
    )
    g.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="FILE",
        help="file with one key per line (# comments allowed); repeatable",
    )
    g.add_argument(
        "--max-concurrency-per-key",
        type=int,
        default=DEFAULTS.max_concurrency_per_key,
        help="choices in flight per API key (a POST /v1 request with `n` choices counts n); more "
        f"get 429 (default {DEFAULTS.max_concurrency_per_key}; 0: no cap)",
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from gateway.app import create_app
    from gateway.config import gateway_config
    from maskwire.config import ConfigError
    from maskwire.logs import setup_logging

    setup_logging(args.log_level)
    try:
        config = gateway_config(args)
    except ConfigError as e:
        print(f"maskwire gateway: {e}", file=sys.stderr)
        return 2
    logging.getLogger("gateway").info(
        "API keys: %s; to the workers: %s",
        f"{len(config.api_keys)} configured" if config.api_keys else "none (the API is open)",
        "plaintext"
        if config.worker_tls is None
        else "mutual TLS"
        if args.worker_tls_cert
        else "TLS",
    )
    app = create_app(config)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler it found, so the
    # process would die of it (status -15). Exit 0 instead, like the gRPC services after a drain.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_after_drain)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=(config.log_level or "info").lower(),
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def _exit_after_drain(signum: int, frame: object) -> None:
    raise SystemExit(0)
