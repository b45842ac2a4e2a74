"""The worker pool: dns:/// targets are expanded and followed; health decides who gets requests."""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterator

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.workers import WorkerPool, parse_addresses
from maskwire.discovery import TargetError
from maskwire.v1 import worker_pb2
from tests.unit.gateway.fake_worker import MODEL, FakeWorkerServer


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


def test_parse_addresses() -> None:
    assert parse_addresses(["a:1,b:2", " c:3 ", "a:1"]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError):
        WorkerPool(GatewayConfig(workers=("",)))
    with pytest.raises(TargetError):
        WorkerPool(GatewayConfig(workers=("no-port",)))


async def test_dns_target_follows_the_replica_set(fake: FakeWorkerServer) -> None:
    ips: list[str] = ["127.0.0.1"]

    async def resolve(host: str, port: int) -> Collection[str]:
        assert host == "workers.example"
        if not ips:
            raise socket.gaierror(socket.EAI_NONAME, "no such name")
        return ips

    config = GatewayConfig(workers=(f"dns:///workers.example:{fake.port}",), health_interval_s=60)
    pool = WorkerPool(config, resolve=resolve)
    await pool.start()
    try:
        assert [ep.address for ep in pool.endpoints] == [fake.address]
        assert (await pool.model_info()).model == MODEL
        out = [m async for m in pool.generate(worker_pb2.GenerateRequest(text="x"), timeout_s=5)]
        assert out[-1].finish_reason == worker_pb2.FINISH_REASON_STOP
        ips.clear()  # every pod went away
        await pool.refresh()
        assert pool.endpoints == []
        with pytest.raises(APIError) as e:
            await pool.model_info()
        assert e.value.status == 503
        ips.append("127.0.0.1")  # and came back
        await pool.refresh()
        assert (await pool.model_info()).model == MODEL
    finally:
        await pool.close()
