"""The gateway's configuration: one frozen `GatewayConfig`, built from the flags and checked in one
place (`gateway_config`), then passed down whole (the app, its `Context`, the request planners).

Each setting's default is defined once, on its field here; the flags (`gateway.cli`) read their
defaults from those fields. This module stays light: the CLI imports it before FastAPI loads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gateway.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES
from maskwire.config import ConfigError
from maskwire.discovery import DEFAULT_REFRESH_S, TargetError, parse_targets
from maskwire.tls import ClientTLS, client_tls_from_args

# The names of `gateway.tool_formats.FORMATS`, spelled out to keep this module light.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `maskwire gateway` flags decide."""

    workers: tuple[str, ...]  # --worker: HOST:PORT or dns:///NAME:PORT targets
    host: str = "127.0.0.1"  # --host
    port: int = 8000  # --port
    chat_template: str | None = None  # --chat-template: template source overriding the model's
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral; None: by the template
    request_timeout_s: float = 600.0  # a request's deadline on the worker (504)
    max_body_bytes: int = 8 * 1024 * 1024  # request body (413)
    max_concurrency: int = 256  # generation requests handled at once (429)
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0  # a worker that does not answer its health check in time is down
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # the prompt text sent to a worker (400)
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # nesting of a body, or of JSON sent as text (400)
    max_n: int = DEFAULT_MAX_N  # choices per request (400 past it)
    worker_dns_refresh_s: float = DEFAULT_REFRESH_S  # how often dns:/// targets are re-resolved
    # Bearer tokens accepted on /v1 (empty: no authentication), see gateway.auth.
    api_keys: tuple[str, ...] = ()
    max_concurrency_per_key: int = 64  # POST /v1 requests in flight per API key (0: no cap)
    worker_tls: ClientTLS | None = None  # TLS/mTLS to the workers (None: plaintext)
    log_level: str | None = None  # --log-level (None: INFO)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The flags (`gateway.cli.add_arguments`) checked and resolved: keys and the chat template
    read, TLS files checked, worker targets parsed; raises `ConfigError` naming the flag."""
    from gateway.auth import load_keys
    from gateway.workers import parse_addresses

    for name in (
        "max_body_bytes",
        "max_concurrency",
        "max_prompt_bytes",
        "max_json_depth",
        "max_n",
    ):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    for name in (
        "request_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "worker_dns_refresh_s",
    ):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.max_concurrency_per_key < 0:
        raise ConfigError("--max-concurrency-per-key must be 0 (no cap) or more")
    if not 0 <= args.port <= 65535:
        raise ConfigError("--port must be a port number, 0 to 65535")
    workers = parse_addresses(args.worker)
    try:
        parse_targets(workers)
    except TargetError as e:
        raise ConfigError(f"--worker: {e}") from e
    return GatewayConfig(
        workers=tuple(workers),
        host=args.host,
        port=args.port,
        chat_template=_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        max_concurrency=args.max_concurrency,
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        max_prompt_bytes=args.max_prompt_bytes,
        max_json_depth=args.max_json_depth,
        max_n=args.max_n,
        worker_dns_refresh_s=args.worker_dns_refresh_s,
        api_keys=tuple(load_keys(args.api_key, args.api_key_file)),
        max_concurrency_per_key=args.max_concurrency_per_key,
        worker_tls=client_tls_from_args(args, "worker"),
        log_level=args.log_level,
    )


def _chat_template(flag: str | None) -> str | None:
    """`--chat-template FILE`'s source, checked to render (None without the flag)."""
    if not flag:
        return None
    path = Path(flag)
    if not path.is_file():
        raise ConfigError(f"--chat-template: no such file: {path}")
    template = path.read_text()
    from gateway.chat_template import ChatTemplate, TemplateError

    try:
        ChatTemplate(template)
    except TemplateError as e:
        raise ConfigError(f"--chat-template {path}: {e}") from e
    return template
