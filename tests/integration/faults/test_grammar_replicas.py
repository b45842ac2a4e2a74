"""Two grammar replicas under one live worker. One stalls (SIGSTOP past the worker's deadline):
only its requests fail. Then one is SIGKILLed mid-generation (its requests continue on the other
replica by replay, every output valid) and restarted on the same port: the worker uses it again.

One stack for both (a worker start costs a model load): the stall leaves both replicas serving,
the kill leaves the stack without them, so the tests run in this file's order."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.faults.support import (
    assert_valid,
    busiest_first,
    first_tokens,
    grammar_replicas,
    live_requests,
    start_constrained,
)
from tests.integration.worker.conftest import channel, generate
from tests.support.processes import ServiceProcess, running

GS_ARGS = ["--tokenizer", "default"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServiceProcess]]:
    with grammar_replicas(2) as r:
        yield r


@pytest.fixture(scope="module")
def worker(replicas: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    addresses = ",".join(r.address for r in replicas)
    args = ["--model", "default", "--grammar-service", addresses, "--grammar-timeout-s", "2"]
    with running("worker", [*args, "--max-seq-len", "512"]) as w:
        yield w


async def test_stalled_replica_fails_its_requests_only(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = start_constrained(stub, 4)
        free = asyncio.create_task(
            generate(stub, "The capital of France is", max_tokens=30, ignore_eos=True)
        )
        await first_tokens(tasks)
        stalled = busiest_first(replicas)[0]  # it holds at least one request
        held = int(live_requests(stalled))
        stalled.kill(signal.SIGSTOP)
        try:
            results = await asyncio.gather(*tasks)
            unconstrained = await free
        finally:
            stalled.kill(signal.SIGCONT)
    errors = [r for r in results if r.final.finish_reason == worker_pb2.FINISH_REASON_ERROR]
    assert len(errors) == held, [r.final for r in results]
    assert all("did not answer" in r.final.error for r in errors)
    for r in results:
        if r not in errors:
            assert_valid(r)
    assert unconstrained.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH


async def test_killed_replica_then_restarted_on_the_same_port(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = start_constrained(stub, 4)
        await first_tokens(tasks)
        a, b = busiest_first(replicas)
        logged = len(worker.log_text())  # the stall above must not count as the replay here
        a.kill(signal.SIGKILL)
        for r in await asyncio.gather(*tasks):
            assert_valid(r)  # nothing lost: A's requests were replayed on B
        assert "re-opened" in worker.log_text()[logged:]

        # A comes back on the same address; then B dies: only A can serve now.
        restarted = ServiceProcess("grammar-service", GS_ARGS, a.port)
        try:
            restarted.wait_ready()
            b.kill(signal.SIGKILL)
            for r in await asyncio.gather(*start_constrained(stub, 2)):
                assert_valid(r)
        finally:
            assert restarted.stop() == 0
