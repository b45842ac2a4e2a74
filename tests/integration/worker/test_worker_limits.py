"""A worker with structured outputs disabled (no grammar service), one slot and a tiny queue."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import SCHEMAS, channel, generate
from tests.support.processes import ServiceProcess, running


@pytest.fixture(scope="module")
def worker() -> Iterator[ServiceProcess]:
    args = ["--model", "default", "--disable-structured-outputs"]
    with running("worker", [*args, "--max-batch-size", "1", "--max-queue", "1"]) as w:
        yield w


async def test_constraint_rejected_with_restart_hint(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
        assert not info.structured_outputs
        req = worker_pb2.GenerateRequest(
            text="x", constraint=common_pb2.Constraint(json_schema=json.dumps(SCHEMAS["person"]))
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(req):
                pass
        err = RpcError.from_call_error(e.value)
        assert err.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "--enable-structured-outputs" in err.message
        # Unconstrained requests still work.
        r = await generate(stub, "The capital of France is", max_tokens=2)
        assert r.text.startswith(" Paris")


async def test_full_queue_is_resource_exhausted(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        long = worker_pb2.SamplingParams(max_tokens=300, ignore_eos=True)
        holder = stub.Generate(worker_pb2.GenerateRequest(request_id="a", text="Hi", sampling=long))
        await holder.read()  # "a" holds the only slot

        async def consume(rid: str) -> list[worker_pb2.GenerateResponse] | grpc.StatusCode:
            call = stub.Generate(
                worker_pb2.GenerateRequest(request_id=rid, text="Hi", sampling=long)
            )
            try:
                return [m async for m in call]
            except grpc.aio.AioRpcError as e:
                return e.code()

        tasks = {asyncio.create_task(consume(f"q{i}")): f"q{i}" for i in range(4)}
        pending = set(tasks)
        while len(pending) > 1:  # one request fits the queue; the other three are refused
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                assert t.result() is grpc.StatusCode.RESOURCE_EXHAUSTED
        (queued,) = pending
        # Aborting the queued request ends its stream at once with ABORT.
        assert (await stub.Abort(worker_pb2.AbortRequest(request_id=tasks[queued]))).found
        msgs = await queued
        assert isinstance(msgs, list)
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_ABORT
        assert msgs[-1].usage.completion_tokens == 0
        holder.cancel()
