"""One client connection cannot take every place in a worker's queue nor its batch slot: with the
queue full of one connection's calls, another connection's call still gets in (the greedy
connection's newest waiting call is refused in its place) and takes the next free slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.support.metrics import metric
from tests.support.processes import ServiceProcess, free_port, running

QUEUE = 3


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(metrics_port: int) -> Iterator[ServiceProcess]:
    args = ["--model", "default", "--disable-structured-outputs", "--max-seq-len", "512"]
    args += ["--metrics-port", str(metrics_port)]
    with running("worker", [*args, "--max-batch-size", "1", "--max-queue", str(QUEUE)]) as w:
        yield w


def connection(address: str) -> grpc.aio.Channel:
    # Channels of one process share a connection unless told not to: one connection per client.
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def _queue_depth_reaches(port: int, depth: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(metric, port, "maskwire_worker_queue_depth") != depth:
        assert time.monotonic() < deadline, f"the worker's queue never held {depth} calls"
        await asyncio.sleep(0.05)


async def _first_message_or_error(
    name: str, call: grpc.aio.UnaryStreamCall, events: list[str]
) -> object:
    try:
        return await call.read()
    except grpc.aio.AioRpcError as e:
        return RpcError.from_call_error(e)
    finally:
        events.append(name)


async def _collect(
    name: str, call: grpc.aio.UnaryStreamCall, events: list[str]
) -> list[worker_pb2.GenerateResponse]:
    msgs = [m async for m in call]
    events.append(name)
    return msgs


async def test_another_connection_gets_in_and_is_served_next(
    worker: ServiceProcess, metrics_port: int
) -> None:
    # The holder runs until it is cancelled: nothing else is admitted while the test sets up.
    holding = worker_pb2.SamplingParams(max_tokens=500, ignore_eos=True, temperature=0)
    long = worker_pb2.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    async with connection(worker.address) as greedy_ch, connection(worker.address) as other_ch:
        greedy = worker_pb2_grpc.WorkerStub(greedy_ch)
        holder = greedy.Generate(worker_pb2.GenerateRequest(text="Count:", sampling=holding))
        await holder.read()  # the greedy connection holds the only batch slot
        # Concurrent calls reach the queue in no set order (the worker tokenizes prompts on
        # several threads): each call is sent once the one before it is queued.
        events: list[str] = []
        queued: list[grpc.aio.UnaryStreamCall] = []
        waits: list[asyncio.Task[object]] = []
        for i in range(QUEUE):
            call = greedy.Generate(
                worker_pb2.GenerateRequest(request_id=f"g{i}", text="Hi", sampling=long)
            )
            queued.append(call)
            waits.append(asyncio.create_task(_first_message_or_error(f"g{i}", call, events)))
            await _queue_depth_reaches(metrics_port, i + 1)
        assert not any(w.done() for w in waits)  # queued: nothing comes before a slot frees
        # Alone, the connection may fill the whole queue, and no more.
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await greedy.Generate(worker_pb2.GenerateRequest(text="Hi", sampling=long)).read()
        assert RpcError.from_call_error(full.value).reason == "QUEUE_FULL"

        # Another connection gets in: the greedy connection's newest waiting call leaves.
        other = worker_pb2_grpc.WorkerStub(other_ch)
        req = worker_pb2.GenerateRequest(
            text="The capital of France is",
            sampling=worker_pb2.SamplingParams(max_tokens=2, temperature=0),
        )
        served = asyncio.create_task(_collect("other", other.Generate(req), events))
        shed = await waits[-1]
        assert isinstance(shed, RpcError) and shed.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert shed.reason == "QUEUE_FULL"

        # It takes the slot when the holder ends (cancelled now), before the greedy calls queued earlier.
        holder.cancel()
        msgs = await served
        assert "".join(m.text for m in msgs).startswith(" Paris"), msgs
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        first = await waits[0]  # the oldest greedy call gets the slot after it
        assert isinstance(first, worker_pb2.GenerateResponse), first
        assert events == [f"g{QUEUE - 1}", "other", "g0"], events
        for c in queued:
            c.cancel()
