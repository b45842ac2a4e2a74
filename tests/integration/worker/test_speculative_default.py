"""Speculative decoding on the worker's default configuration (compiled graphs, bf16 where the CPU
computes it natively, 4-bit decode kernels from the Q4_1 checkpoint): every request's output is
the same with `--speculative ngram` as without it, alone and in a full batch where greedy,
seeded top-p / top-k sampling and constrained requests share the passes.

`test_speculative_e2e.py` checks the same on the reference configuration (eager float32);
`test_default_quality.py` checks, on the forward passes themselves, why it holds here: a
verification row's logits are those of its tokens decoded one by one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest

from maskwire.v1 import common_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import Result, cases, channel, chat, generate
from tests.integration.worker.test_speculative_e2e import PASSAGES, RECORD, extraction, same
from tests.integration.worker.test_worker_compiled import COLD_START_S, FAST
from tests.support.processes import ServiceProcess, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@dataclass(frozen=True)
class Job:
    label: str
    prompt: str
    constraint: common_pb2.Constraint | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


def jobs() -> list[Job]:
    """Greedy and seeded sampled requests, constrained and not, some copying their prompt (so
    drafts are proposed and accepted)."""
    record = common_pb2.Constraint(json_schema=json.dumps(RECORD))
    copy = chat("Repeat this sentence twice: " + PASSAGES[0])
    picked = ("schema-person", "schema-enum_bool", "regex", "choice")
    out = [
        Job(c.name, c.prompt, c.constraint, {"max_tokens": 40}) for c in cases() if c.name in picked
    ]
    out += [
        Job(f"extract-{i}", extraction(p), record, {"max_tokens": 80})
        for i, p in enumerate(PASSAGES)
    ]
    out += [
        Job("copy", copy, None, {"max_tokens": 60}),
        Job("free", "Once upon a time", None, {"max_tokens": 40}),
        # Seeded sampling: top-p, top-k and both, one of them constrained.
        Job(
            "sample-top-p",
            copy,
            None,
            {"max_tokens": 60, "temperature": 0.5, "top_p": 0.9, "seed": 1},
        ),
        Job(
            "sample-top-k-record",
            extraction(PASSAGES[1]),
            record,
            {"max_tokens": 80, "temperature": 0.7, "top_k": 20, "seed": 2},
        ),
        Job(
            "sample-both",
            extraction(PASSAGES[2]),
            None,
            {"max_tokens": 60, "temperature": 1.0, "top_p": 0.8, "top_k": 40, "seed": 3},
        ),
    ]
    return out


@pytest.fixture(scope="module")
def worker() -> Iterator[ServiceProcess]:
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        args = [
            *("--model", "default", "--grammar-service", gs.address, *FAST),
            *("--speculative", "ngram", "--max-batch-size", "8", "--max-seq-len", "512"),
        ]
        with running("worker", args, timeout_s=COLD_START_S) as w:
            yield w


async def run_all(
    stub: worker_pb2_grpc.WorkerStub, *, speculate: list[bool], together: bool
) -> list[Result]:
    """Every job, one after another or all at once (more than a batch: some wait for a row)."""
    calls = [
        generate(stub, job.prompt, job.constraint, disable_speculation=not on, **job.sampling)
        for job, on in zip(jobs(), speculate, strict=True)
    ]
    if together:
        return list(await asyncio.gather(*calls))
    return [await c for c in calls]


@pytest.fixture(scope="module")
def reference(worker: ServiceProcess) -> list[Result]:
    """Each job alone, speculation off."""

    async def collect() -> list[Result]:
        async with channel(worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return await run_all(stub, speculate=[False] * len(jobs()), together=False)

    return asyncio.run(collect())


def check(results: list[Result], reference: list[Result]) -> None:
    for job, got, want in zip(jobs(), results, reference, strict=True):
        same(got, want, job.label)
        if job.constraint is not None and job.label.startswith("extract"):
            jsonschema.validate(json.loads(got.text), RECORD)


async def test_outputs_are_identical_alone(worker: ServiceProcess, reference: list[Result]) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        got = await run_all(stub, speculate=[True] * len(jobs()), together=False)
    check(got, reference)
    usage = {job.label: r.final.usage for job, r in zip(jobs(), got, strict=True)}
    # The copies are drafted and accepted: speculation ran on this path, greedy and sampled.
    for label in ("extract-0", "copy"):
        assert usage[label].accepted_draft_tokens > 0, (label, usage[label])
    sampled = [u for label, u in usage.items() if label.startswith("sample")]
    assert sum(u.accepted_draft_tokens for u in sampled) > 0, sampled


async def test_outputs_are_identical_in_a_mixed_batch(
    worker: ServiceProcess, reference: list[Result]
) -> None:
    """c8: every job at once, every fourth opted out of speculation: each output is the one it
    has alone without speculation."""
    n = len(jobs())
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        got = await run_all(stub, speculate=[i % 4 != 3 for i in range(n)], together=True)
    check(got, reference)
    assert sum(r.final.usage.accepted_draft_tokens for r in got) > 0
