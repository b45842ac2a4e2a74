"""The flags every maskwire gRPC server takes (where to listen, metrics, drain, logs, TLS, loop),
and the checked `ServerConfig` they build."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskwire.config import ConfigError
from maskwire.event_loop import add_event_loop_argument
from maskwire.tls import add_server_tls_arguments, server_credentials_from_args

if TYPE_CHECKING:  # grpc is imported where credentials are built: CLI modules stay light
    import grpc


def add_host_argument(g: argparse._ActionsContainer, default: str = "127.0.0.1") -> None:
    """`--host`: the address a service binds (every service: gRPC and HTTP alike)."""
    g.add_argument("--host", default=default, help=f"address to bind (default {default})")


def add_grpc_server_arguments(
    p: argparse.ArgumentParser, *, port: int, drain_grace_s: float
) -> None:
    """Where a gRPC service listens, its metrics, drain, logs and event loop; then its TLS."""
    g = p.add_argument_group("server")
    add_host_argument(g)
    g.add_argument(
        "--port", type=int, default=port, help=f"gRPC port (default {port}; 0 picks a free one)"
    )
    g.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: disabled)"
    )
    g.add_argument(
        "--drain-grace-s",
        type=float,
        default=drain_grace_s,
        help=f"on SIGTERM, time for in-flight work (default {drain_grace_s:g})",
    )
    g.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING... (default INFO)")
    add_event_loop_argument(g)
    add_server_tls_arguments(p)


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a gRPC service listens: the flags `add_grpc_server_arguments` adds."""

    host: str
    port: int  # 0: a free one
    metrics_port: int  # 0: no /metrics server
    health_port: int  # 0: no extra plaintext health port
    drain_grace_s: float
    log_level: str | None
    event_loop: str
    credentials: grpc.ServerCredentials | None  # checked at start-up; None: plaintext
    tls_mode: str  # "plaintext", "TLS" or "mutual TLS", for the start-up log line


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server flags, checked (ports in range, certificate files readable and matching);
    raises `ConfigError` naming the flag."""
    for flag, value in (
        ("--port", args.port),
        ("--metrics-port", args.metrics_port),
        ("--health-port", args.health_port),
    ):
        if not 0 <= value <= 65535:
            raise ConfigError(f"{flag} must be a port number, 0 to 65535 (0: {_zero(flag)})")
    if args.drain_grace_s < 0:
        raise ConfigError("--drain-grace-s must be >= 0")
    credentials = server_credentials_from_args(args)
    mode = "plaintext" if credentials is None else "mutual TLS" if args.tls_client_ca else "TLS"
    return ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        drain_grace_s=args.drain_grace_s,
        log_level=args.log_level,
        event_loop=args.event_loop,
        credentials=credentials,
        tls_mode=mode,
    )


def _zero(flag: str) -> str:
    return "a free one" if flag == "--port" else "none"
