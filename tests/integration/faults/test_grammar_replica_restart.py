"""A grammar replica SIGKILLed mid-generation (its requests continue on the other replica by
replay, every output valid), then restarted on the same port: the worker uses it again."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from maskwire.v1 import worker_pb2_grpc
from tests.integration.faults.support import (
    assert_valid,
    busiest_first,
    first_tokens,
    grammar_replicas,
    start_constrained,
)
from tests.integration.worker.conftest import channel
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


async def test_killed_replica_then_restarted_on_the_same_port(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = start_constrained(stub, 4)
        await first_tokens(tasks)
        a, b = busiest_first(replicas)
        a.kill(signal.SIGKILL)
        for r in await asyncio.gather(*tasks):
            assert_valid(r)  # nothing lost: A's requests were replayed on B
        assert "re-opened" in worker.log_text()

        # A comes back on the same address; then B dies: only A can serve now.
        restarted = ServiceProcess("grammar-service", GS_ARGS, a.port)
        try:
            restarted.wait_ready()
            b.kill(signal.SIGKILL)
            for r in await asyncio.gather(*start_constrained(stub, 2)):
                assert_valid(r)
        finally:
            assert restarted.stop() == 0
