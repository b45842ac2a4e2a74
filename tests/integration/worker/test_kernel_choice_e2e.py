"""A real worker with `--quantize auto` on the embedded Q4_1 model: it times the decode kernels
per kind of projection at start, logs the table and its choice, serves with it, and a restart
reads the table from its cache instead of timing again (`neuron_worker.kernel_choice`).

Eager, to start fast: the choice is made where the model loads, compiled or not. The cache
lives in a private `$XDG_CACHE_HOME` (an eager worker keeps its kernels and the table under the
default compile cache root), so the worker builds its kernels there once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from maskwire.v1 import worker_pb2, worker_pb2_grpc
from neuron_worker.kernels import cpu_kernel_set
from neuron_worker.tuning import native_bf16
from tests.integration.worker.conftest import channel, generate
from tests.support.processes import TEST_WORKER_DEVICE, ServiceProcess, running

pytestmark = [
    pytest.mark.slow,  # two worker starts that build the kernels in a private cache (~1.5 min)
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        TEST_WORKER_DEVICE != "cpu" or not (native_bf16("cpu") or cpu_kernel_set() is not None),
        reason="the decode kernels are timed on a CPU with bf16 or the worker's fp32 kernels",
    ),
]

KINDS = ("wqkv", "wo", "w13", "w2", "head")
# A kind's line of the table (after the log record's prefix): its choice after "->", or its one
# candidate.
CHOICE = re.compile(r" {2}(\w+) \[\d+x\d+\]: (?:.*-> (\w+)|(\w+) \(the only candidate\))$", re.M)


def choices(log: str) -> dict[str, str]:
    return {m.group(1): m.group(2) or m.group(3) for m in CHOICE.finditer(log)}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The logs of a first start (timing) and of a restart (the cache), each after serving a
    request."""
    with (
        pytest.MonkeyPatch.context() as mp,
        running("grammar-service", ["--tokenizer", "default"]) as gs,
    ):
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        args = [
            *("--model", "default", "--grammar-service", gs.address),
            *("--dtype", "auto", "--quantize", "auto", "--max-seq-len", "256"),
        ]
        found = []
        for _ in range(2):
            with running("worker", args, timeout_s=600) as worker:
                serve_one(worker)
                found.append(worker.log_text())
        yield found[0], found[1]


def serve_one(worker: ServiceProcess) -> None:
    async def request() -> None:
        async with channel(worker.address) as ch:
            r = await generate(
                worker_pb2_grpc.WorkerStub(ch), "The capital of France is", max_tokens=4
            )
        assert r.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH and len(r.ids) == 4
        assert r.text.strip(), r

    asyncio.run(request())


def test_the_worker_times_the_kernels_and_logs_its_choice(logs: tuple[str, str]) -> None:
    first, _ = logs
    assert "quantize auto" in first
    assert re.search(r"decode kernels timed in \d+\.\d s, cached in \S+choice-\w+\.json", first)
    chosen = choices(first)
    assert set(chosen) == set(KINDS), first[-4000:]
    assert set(chosen.values()) <= {"int4", "int8", "dense"}


def test_a_restart_reads_the_choice_from_its_cache(logs: tuple[str, str]) -> None:
    first, second = logs
    assert "decode kernels read from" in second and "decode kernels timed" not in second
    assert choices(second) == choices(first)
