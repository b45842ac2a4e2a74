"""One client connection cannot take every place in a worker's queue nor its batch slot: with the
queue full of one connection's calls, another connection's call still gets in (the greedy
connection's newest waiting call is refused in its place) and takes the next free slot."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.support.processes import ServiceProcess, running

QUEUE = 3


@pytest.fixture(scope="module")
def worker() -> Iterator[ServiceProcess]:
    args = ["--model", "default", "--disable-structured-outputs", "--max-seq-len", "256"]
    with running("worker", [*args, "--max-batch-size", "1", "--max-queue", str(QUEUE)]) as w:
        yield w


def connection(address: str) -> grpc.aio.Channel:
    # Channels of one process share a connection unless told not to: one connection per client.
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


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


async def test_another_connection_gets_in_and_is_served_next(worker: ServiceProcess) -> None:
    long = worker_pb2.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    async with connection(worker.address) as greedy_ch, connection(worker.address) as other_ch:
        greedy = worker_pb2_grpc.WorkerStub(greedy_ch)
        holder = greedy.Generate(worker_pb2.GenerateRequest(text="Count:", sampling=long))
        await holder.read()  # the greedy connection holds the only batch slot
        queued = [
            greedy.Generate(
                worker_pb2.GenerateRequest(request_id=f"g{i}", text="Hi", sampling=long)
            )
            for i in range(QUEUE)
        ]
        events: list[str] = []
        waits = [
            asyncio.create_task(_first_message_or_error(f"g{i}", c, events))
            for i, c in enumerate(queued)
        ]
        await asyncio.sleep(1.0)  # queued (nothing comes before a slot frees)
        assert not any(w.done() for w in waits)
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

        # It takes the slot when the holder finishes, before the greedy calls queued earlier.
        msgs = await served
        assert "".join(m.text for m in msgs).startswith(" Paris"), msgs
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        first = await waits[0]  # the oldest greedy call gets the slot after it
        assert isinstance(first, worker_pb2.GenerateResponse), first
        assert events == [f"g{QUEUE - 1}", "other", "g0"], events
        for c in [holder, *queued]:
            c.cancel()
