"""Prometheus metrics of one gateway app (own registry, so several apps can live in a process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "maskwire_gateway_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "maskwire_gateway_request_seconds",
            "Time from request to last byte, generation endpoints",
            ["endpoint", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "maskwire_gateway_time_to_first_token_seconds",
            "Time from request to the worker's first output",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "maskwire_gateway_requests_in_flight", "Generation requests in progress", registry=r
        )
        self.tokens = Counter(
            "maskwire_gateway_tokens", "Tokens by kind (prompt, completion)", ["kind"], registry=r
        )
        self.tool_calls = Counter(
            "maskwire_gateway_tool_calls",
            "Tool calls returned, by tool_choice mode",
            ["mode"],
            registry=r,
        )
        self.cancelled = Counter(
            "maskwire_gateway_client_disconnects",
            "Requests whose client went away; their worker call was cancelled",
            registry=r,
        )
        self.rejected = Counter(
            "maskwire_gateway_rejected",
            "Requests refused before reaching a worker, by reason",
            ["reason"],
            registry=r,
        )
        self.worker_up = Gauge(
            "maskwire_gateway_worker_up",
            "1 when the worker passes health checks",
            ["worker"],
            registry=r,
        )

    def set_worker_health(self, address: str, healthy: bool) -> None:
        self.worker_up.labels(address).set(1 if healthy else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
