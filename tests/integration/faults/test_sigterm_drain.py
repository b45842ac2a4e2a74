"""SIGTERM drains each service: in-flight work finishes within the grace period and the process
exits 0. Grammar replica: its requests move to the other replica (replay), all outputs valid.
Gateway: an open SSE stream runs to `[DONE]`. Worker: an in-flight request completes."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator

import httpx
import pytest

from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.faults.support import (
    assert_valid,
    busiest_first,
    first_tokens,
    grammar_replicas,
    start_constrained,
)
from tests.integration.worker.conftest import channel, generate
from tests.support.processes import ServiceProcess, running

GRACE_S = 20.0


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServiceProcess]]:
    with grammar_replicas(2, "--drain-grace-s", str(GRACE_S)) as r:
        yield r


@pytest.fixture(scope="module")
def worker(replicas: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    addresses = ",".join(r.address for r in replicas)
    args = ["--model", "default", "--grammar-service", addresses, "--drain-grace-s", str(GRACE_S)]
    with running("worker", [*args, "--max-seq-len", "512"]) as w:
        yield w


def _exit_code(svc: ServiceProcess) -> int:
    return svc.proc.wait(GRACE_S + 15)


async def test_grammar_replica_drains(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = start_constrained(stub, 4)
        await first_tokens(tasks)
        busy = busiest_first(replicas)[0]
        busy.kill(signal.SIGTERM)
        for r in await asyncio.gather(*tasks):
            assert_valid(r)
    assert await asyncio.to_thread(_exit_code, busy) == 0
    assert "re-opened" in worker.log_text()


def test_gateway_drains_an_open_stream(worker: ServiceProcess) -> None:
    with running("gateway", ["--worker", worker.address], http=True) as gw:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 60,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        lines: list[str] = []
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"http://{gw.address}/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 3:
                    gw.kill(signal.SIGTERM)  # mid-stream
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert _exit_code(gw) == 0


async def test_worker_drains_in_flight_requests(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        started = asyncio.Event()
        task = asyncio.create_task(
            generate(stub, "Once upon a time", max_tokens=32, ignore_eos=True, started=started)
        )
        # Mid-generation: after its first token (a fixed sleep raced a loaded machine's prefill)
        # and with few enough tokens left to finish within the grace period on a loaded one.
        await asyncio.wait_for(started.wait(), 60)
        worker.kill(signal.SIGTERM)
        r = await task
    assert r.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH, r.final
    assert len(r.ids) == r.final.usage.completion_tokens == 32
    assert await asyncio.to_thread(_exit_code, worker) == 0
