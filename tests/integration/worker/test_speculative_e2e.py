"""Speculative decoding end to end: a real worker (embedded SmolLM2, `--speculative ngram`) and
real grammar replicas. Each request runs twice on the same worker, with speculation and opted out
(`GenerateRequest.disable_speculation`): greedy outputs must be identical, constrained and not,
alone and in mixed batches; a workload that copies its prompt needs fewer forward passes per
token, one that does not never needs more; a grammar replica killed mid-speculation is replayed.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.faults.support import busiest_first, grammar_replicas
from tests.integration.worker.conftest import SCHEMAS, Result, cases, channel, chat, generate
from tests.support.processes import ServiceProcess, running

# ~110 s on 2 cores (references at 15-20 tokens/s, then every job again): the slow stage of
# .ci/run; tests/unit/worker/test_speculative.py covers the step loop in the default run.
pytestmark = pytest.mark.slow

FR = worker_pb2

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "job": {"type": "string"},
        "building": {"type": "string"},
    },
    "required": ["name", "city", "job", "building"],
    "additionalProperties": False,
}
PASSAGES = [
    "Maria Gonzalez, an architect from Valencia, designed the Riverside Public Library.",
    "Tomasz Nowak is a baker in Krakow who runs the Old Mill Bakery near the river.",
    "Dr. Aiko Tanaka, a surgeon from Osaka, works at the Sakura General Hospital.",
]


def extraction(passage: str) -> str:
    return chat(
        f"Passage: {passage}\nExtract a JSON record with the person's name, city, job and the "
        "building named in the passage, copying the words from the passage."
    )


# (label, prompt, constraint, max_tokens)
Job = tuple[str, str, common_pb2.Constraint | None, int]


def jobs() -> list[Job]:
    out: list[Job] = [(c.name, c.prompt, c.constraint, 48) for c in cases()]
    record = common_pb2.Constraint(json_schema=json.dumps(RECORD))
    out += [(f"extract-{i}", extraction(p), record, 80) for i, p in enumerate(PASSAGES)]
    out.append(("copy", chat("Repeat this sentence twice: " + PASSAGES[0]), None, 60))
    out.append(("free", "Once upon a time", None, 40))
    return out


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServiceProcess]]:
    with grammar_replicas(2) as r:
        yield r


@pytest.fixture(scope="module")
def worker(replicas: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    addresses = ",".join(r.address for r in replicas)
    args = ["--model", "default", "--grammar-service", addresses, "--grammar-timeout-s", "5"]
    spec = ["--speculative", "ngram", "--num-draft-tokens", "4"]
    with running("worker", [*args, *spec, "--max-batch-size", "8", "--max-seq-len", "512"]) as w:
        yield w


async def run(stub: worker_pb2_grpc.WorkerStub, job: Job, *, speculate: bool) -> Result:
    _, prompt, constraint, max_tokens = job
    return await generate(
        stub, prompt, constraint, disable_speculation=not speculate, max_tokens=max_tokens
    )


@pytest.fixture(scope="module")
def reference(worker: ServiceProcess) -> dict[str, Result]:
    """Every job alone, speculation off."""

    async def collect() -> dict[str, Result]:
        async with channel(worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return {job[0]: await run(stub, job, speculate=False) for job in jobs()}

    return asyncio.run(collect())


def same(got: Result, want: Result, label: str) -> None:
    assert got.ids == want.ids and got.text == want.text, (label, got.text, want.text)
    assert got.final.finish_reason == want.final.finish_reason, label


async def test_greedy_outputs_are_identical_alone(
    worker: ServiceProcess, reference: dict[str, Result]
) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        got = {job[0]: await run(stub, job, speculate=True) for job in jobs()}
    for label, r in got.items():
        want = reference[label]
        same(r, want, label)
        u, u0 = r.final.usage, want.final.usage
        # Speculation never costs forward passes (a verification pass yields >= 1 token).
        assert u.forward_passes <= u0.forward_passes, (label, u, u0)
        assert u0.draft_tokens == 0 and u.accepted_draft_tokens <= u.draft_tokens
    for i in range(len(PASSAGES)):
        r = got[f"extract-{i}"]
        jsonschema.validate(json.loads(r.text), RECORD)
    extract = [got[f"extract-{i}"].final.usage for i in range(len(PASSAGES))]
    base = [reference[f"extract-{i}"].final.usage for i in range(len(PASSAGES))]
    # The record copies the passage: drafts are accepted and passes are saved.
    assert sum(u.accepted_draft_tokens for u in extract) > 0
    assert sum(u.forward_passes for u in extract) < sum(u.forward_passes for u in base)


async def test_greedy_outputs_are_identical_in_a_mixed_batch(
    worker: ServiceProcess, reference: dict[str, Result]
) -> None:
    """c8: every job at once, some opted out: same outputs as each alone without speculation."""
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        all_jobs = jobs()
        results = await asyncio.gather(
            *(run(stub, job, speculate=i % 4 != 3) for i, job in enumerate(all_jobs))
        )
    for job, r in zip(all_jobs, results, strict=True):
        same(r, reference[job[0]], job[0])


async def test_seeded_sampling_reproduces(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        kw: dict[str, Any] = {"temperature": 0.8, "seed": 7, "max_tokens": 40}
        prompt = extraction(PASSAGES[1])
        a = await generate(stub, prompt, **kw)
        b = await generate(stub, prompt, **kw)
    assert a.ids == b.ids and a.text == b.text


async def test_seeded_sampling_is_the_same_with_or_without_speculation(
    worker: ServiceProcess,
) -> None:
    """A position's token is drawn with the same counter-based random number either way, so a
    seed gives the same record: the tokens the grammar forces after drafts that close a string
    (kept without a draw) take no counter, as jump-forward tokens take none."""
    record = common_pb2.Constraint(json_schema=json.dumps(RECORD))
    kw: dict[str, Any] = {"temperature": 0.7, "seed": 11, "max_tokens": 80}
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for passage in PASSAGES:
            prompt = extraction(passage)
            on = await generate(stub, prompt, record, **kw)
            off = await generate(stub, prompt, record, disable_speculation=True, **kw)
            assert on.ids == off.ids, (on.text, off.text)
            assert on.final.usage.accepted_draft_tokens > 0, on.text


# Long enough that a quiet machine is still generating when the replica dies: speculation
# copies the repeated items, so the faults suite's three-item list can finish within a second.
LONG_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": SCHEMAS["person"],
    "minItems": 24,
    "maxItems": 24,
}


async def test_killed_replica_mid_speculation_is_replayed(
    worker: ServiceProcess, replicas: list[ServiceProcess]
) -> None:
    """Runs last: it kills a replica of the module's pair."""
    constraint = common_pb2.Constraint(json_schema=json.dumps(LONG_SCHEMA))
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        tasks = [
            asyncio.create_task(
                generate(stub, chat(f"24 people as JSON, set {i}."), constraint, max_tokens=600)
            )
            for i in range(4)
        ]
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in tasks), [t.result().text for t in tasks if t.done()]
        busiest_first(replicas)[0].kill(signal.SIGKILL)
        for r in await asyncio.gather(*tasks):
            assert r.final.finish_reason == worker_pb2.FINISH_REASON_STOP, (r.final, r.text)
            jsonschema.validate(json.loads(r.text), LONG_SCHEMA)
    assert "re-opened" in worker.log_text()
