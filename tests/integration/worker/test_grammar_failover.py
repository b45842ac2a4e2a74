"""Grammar replicas failing under a live worker: killed (replay elsewhere) and stalled (deadline)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator

import pytest

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import SCHEMAS, Result, channel, chat, generate
from tests.support.processes import ServiceProcess, running

# Long enough (tens of tokens) that a replica can die mid-generation.
LIST_SCHEMA = {
    "type": "array",
    "items": SCHEMAS["person"],
    "minItems": 3,
    "maxItems": 3,
}


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServiceProcess]]:
    with (
        running("grammar-service", ["--tokenizer", "default"]) as a,
        running("grammar-service", ["--tokenizer", "default"]) as b,
    ):
        yield [a, b]


@pytest.fixture(scope="module")
def worker(replicas: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    addresses = ",".join(r.address for r in replicas)
    args = ["--model", "default", "--grammar-service", addresses, "--grammar-timeout-s", "2"]
    with running("worker", [*args, "--max-seq-len", "512"]) as w:
        yield w


def _valid(r: Result) -> None:
    import jsonschema

    assert r.final.finish_reason == worker_pb2.FINISH_REASON_STOP, (r.final, r.text)
    jsonschema.validate(json.loads(r.text), LIST_SCHEMA)


async def _start(stub: worker_pb2_grpc.WorkerStub, n: int) -> list[asyncio.Task[Result]]:
    constraint = common_pb2.Constraint(json_schema=json.dumps(LIST_SCHEMA))
    return [
        asyncio.create_task(
            generate(stub, chat(f"Three people as JSON, set {i}."), constraint, max_tokens=120)
        )
        for i in range(n)
    ]


async def test_stalled_replica_fails_its_requests_only(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    stalled = replicas[1]
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = await _start(stub, 4)  # placed 2 + 2
        await asyncio.sleep(0)
        free = asyncio.create_task(
            generate(stub, "The capital of France is", max_tokens=30, ignore_eos=True)
        )
        await asyncio.sleep(1.0)
        stalled.kill(signal.SIGSTOP)
        try:
            results = await asyncio.gather(*tasks)
            unconstrained = await free
        finally:
            stalled.kill(signal.SIGCONT)
    errors = [r for r in results if r.final.finish_reason == worker_pb2.FINISH_REASON_ERROR]
    assert errors, "no request was on the stalled replica"
    assert all("did not answer" in r.final.error for r in errors)
    for r in results:
        if r not in errors:
            _valid(r)
    assert unconstrained.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH


async def test_killed_replica_requests_continue_on_the_other(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    await asyncio.sleep(1.0)  # let the stalled replica's back-off from the previous test expire
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = await _start(stub, 4)
        await asyncio.sleep(1.5)  # mid-generation
        assert not any(t.done() for t in tasks)
        replicas[0].kill(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    for r in results:
        _valid(r)
    assert "re-opened" in worker.log_text()
