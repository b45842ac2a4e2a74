"""The only grammar replica stalls (SIGSTOP) mid-generation: constrained requests fail with a clear
deadline error within the worker's --grammar-timeout-s, unconstrained requests in the same batch
finish normally, and after SIGCONT constrained requests work again."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.faults.support import assert_valid, first_tokens, start_constrained
from tests.integration.worker.conftest import channel, generate
from tests.support.processes import ServiceProcess, grammar_and_worker


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with grammar_and_worker(["--grammar-timeout-s", "1", "--max-seq-len", "512"]) as (gs, w):
        yield gs, w


async def test_stalled_grammar_fails_constrained_requests_only(
    stack: tuple[ServiceProcess, ServiceProcess],
) -> None:
    gs, worker = stack
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        constrained = start_constrained(stub, 3)
        free = [
            asyncio.create_task(
                generate(stub, f"Story {i}: once upon a time", max_tokens=40, ignore_eos=True)
            )
            for i in range(2)
        ]
        await first_tokens(constrained)
        gs.kill(signal.SIGSTOP)
        try:
            # Bounded: the per-step deadline must end them, not this test's timeout.
            results = await asyncio.wait_for(asyncio.gather(*constrained), 60)
            unconstrained = await asyncio.wait_for(asyncio.gather(*free), 60)
        finally:
            gs.kill(signal.SIGCONT)
        for r in results:
            assert r.final.finish_reason == worker_pb2.FINISH_REASON_ERROR, r.final
            assert "did not answer" in r.final.error, r.final.error
        for u in unconstrained:
            assert u.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH
            assert u.final.usage.completion_tokens == 40

        # The replica is back: constrained requests succeed again.
        for r in await asyncio.wait_for(asyncio.gather(*start_constrained(stub, 2)), 120):
            assert_valid(r)
