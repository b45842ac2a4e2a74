"""Helpers for the fault tests: constrained requests long enough to be hit mid-generation, and
their checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import jsonschema

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import SCHEMAS, Result, chat, generate
from tests.support.metrics import metric
from tests.support.processes import ServiceProcess, free_port, running

# Tens of tokens: long enough that a fault lands mid-generation.
LIST_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": SCHEMAS["person"],
    "minItems": 3,
    "maxItems": 3,
}
LIST_CONSTRAINT = common_pb2.Constraint(json_schema=json.dumps(LIST_SCHEMA))


def assert_valid(r: Result) -> None:
    assert r.final.finish_reason == worker_pb2.FINISH_REASON_STOP, (r.final, r.text)
    jsonschema.validate(json.loads(r.text), LIST_SCHEMA)


class Constrained(list[asyncio.Task[Result]]):
    """Running requests, each with an event set when its first tokens arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[asyncio.Event] = []


def start_constrained(stub: worker_pb2_grpc.WorkerStub, n: int) -> Constrained:
    out = Constrained()
    for i in range(n):
        started = asyncio.Event()
        prompt = chat(f"Three people as JSON, set {i}.")
        out.append(
            asyncio.create_task(
                generate(stub, prompt, LIST_CONSTRAINT, max_tokens=120, started=started)
            )
        )
        out.started.append(started)
    return out


async def first_tokens(tasks: Constrained, seconds: float = 0.1) -> None:
    """Wait until every request has streamed tokens (its grammar has answered steps: a fault
    then lands mid-generation, however loaded the host), then `seconds` more; check that none
    has finished yet."""
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in tasks.started)), 120)
    await asyncio.sleep(seconds)
    assert not any(t.done() for t in tasks), "requests finished before the fault"


@contextmanager
def grammar_replicas(n: int, *args: str) -> Iterator[list[ServiceProcess]]:
    """`n` grammar-service processes, each with a metrics port (`.metrics_port`)."""
    with ExitStack() as stack:
        out = []
        for _ in range(n):
            port = free_port()
            svc = stack.enter_context(
                running(
                    "grammar-service",
                    ["--tokenizer", "default", "--metrics-port", str(port), *args],
                )
            )
            svc.metrics_port = port  # type: ignore[attr-defined]
            out.append(svc)
        yield out


def live_requests(svc: ServiceProcess) -> float:
    return metric(svc.metrics_port, "maskwire_grammar_live_requests")  # type: ignore[attr-defined]


def busiest_first(replicas: list[ServiceProcess]) -> list[ServiceProcess]:
    """Replicas by live requests, most first: concurrent opens may all land on one replica."""
    ranked = sorted(replicas, key=live_requests, reverse=True)
    assert live_requests(ranked[0]) > 0, "no replica holds a request"
    return ranked
