"""The flags every maskwire gRPC server takes: where to listen, metrics, drain, logs, TLS, loop."""

from __future__ import annotations

import argparse

from maskwire.event_loop import add_event_loop_argument
from maskwire.tls import add_server_tls_arguments


def add_grpc_server_arguments(
    p: argparse.ArgumentParser, *, port: int, drain_grace_s: float
) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=port, help=f"gRPC port (default {port}; 0 picks a free one)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: disabled)"
    )
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=drain_grace_s,
        help=f"on SIGTERM, time for in-flight work (default {drain_grace_s:g})",
    )
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING... (default INFO)")
    add_server_tls_arguments(p)
    add_event_loop_argument(p)
