"""The XLA worker with `--disable-structured-outputs`: its sampler graph takes no mask (checked
in-process in test_sampler_graph.py), constrained requests fail FAILED_PRECONDITION, and
unconstrained traffic compiles nothing after warm-up. One batch bucket and two token buckets keep
warm-up short."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from maskwire.v1 import common_pb2, worker_pb2
from tests.support.processes import ServiceProcess, free_port, running
from tests.xla.support import PERSON, Case, chat, generate, generate_all, mixed_cases, scrape

pytestmark = [pytest.mark.xla, pytest.mark.timeout(1800)]  # warm-up compiles for minutes

ARGS = [
    "--device", "xla", "--disable-structured-outputs",
    "--max-batch-size", "2", "--batch-buckets", "2",
    "--max-seq-len", "128", "--seq-buckets", "128", "--token-buckets", "1,128",
]  # fmt: skip


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    with running("worker", [*ARGS, "--metrics-port", str(port)], timeout_s=1500) as w:
        yield w, port


async def test_constrained_requests_are_rejected(worker: tuple[ServiceProcess, int]) -> None:
    w, _ = worker
    case = Case("schema", chat("A person?"), common_pb2.Constraint(json_schema=json.dumps(PERSON)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(w.address, case)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-structured-outputs" in (err.value.details() or "")


async def test_unconstrained_traffic_compiles_nothing(worker: tuple[ServiceProcess, int]) -> None:
    w, port = worker
    cases = [c for c in mixed_cases() if c.constraint is None]
    before = scrape(port)["maskwire_worker_xla_compilations_total"]
    out = await generate_all(w.address, cases)
    assert scrape(port)["maskwire_worker_xla_compilations_total"] == before
    # The greedy references (NOTES.md): same tokens as the CPU backend.
    assert out["plain-raw"].text.startswith(" Paris.")
    assert out["plain-chat"].text == "The capital of France is Paris."
    assert out["plain-chat"].finish_reason == worker_pb2.FINISH_REASON_STOP
