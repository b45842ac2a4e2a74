"""A real worker started with compiled graphs (`--compile --warmup`): torch.compile'd forward and
sampler, every graph built before serving, on the smallest buckets (one batch row, a 64-token
context, token buckets 1 and 64: two forward graphs and the three single-row sampler graphs).

Slow: compiling the forward graphs of the 30-layer model takes minutes on a cold 2-core host.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import CHOICES, REGEX, SCHEMAS, channel, chat, generate
from tests.support.processes import ServiceProcess, grammar_and_worker

pytestmark = pytest.mark.slow

SMALLEST = [
    *("--compile", "--warmup", "--max-batch-size", "1", "--batch-buckets", "1"),
    *("--max-seq-len", "64", "--seq-buckets", "64", "--token-buckets", "1"),
]


@pytest.fixture(scope="module")
def worker() -> Iterator[ServiceProcess]:
    with grammar_and_worker(SMALLEST) as (_, w):
        log = w.log_text()
        assert "compiling forward with torch.compile" in log and "warming up the sampler" in log
        yield w


async def test_unconstrained_greedy(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        r = await generate(worker_pb2_grpc.WorkerStub(ch), "The capital of France is", max_tokens=3)
    assert r.text.startswith(" Paris"), r.text
    assert r.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 7},  # the sample graph
        {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7},  # the filter graph
    ],
    ids=["greedy", "sample", "filter"],
)
async def test_constrained_outputs_are_valid(
    worker: ServiceProcess, sampling: dict[str, float]
) -> None:
    import re

    schema = SCHEMAS["enum_bool"]
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        choice = await generate(
            stub,
            chat("Capital of France?"),
            common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=CHOICES)),
            max_tokens=8,
            **sampling,
        )
        regex = await generate(
            stub, chat("A phone number?"), common_pb2.Constraint(regex=REGEX), **sampling
        )
        js = await generate(
            stub,
            chat("A color as JSON."),
            common_pb2.Constraint(json_schema=json.dumps(schema)),
            max_tokens=30,
            **sampling,
        )
    for r in (choice, regex, js):
        assert r.final.finish_reason == worker_pb2.FINISH_REASON_STOP, (r.final, r.text)
    assert choice.text in CHOICES
    assert re.fullmatch(REGEX, regex.text), regex.text
    jsonschema.validate(json.loads(js.text), schema)
