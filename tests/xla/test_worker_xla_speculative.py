"""The XLA worker with `--speculative ngram`: verification passes run graphs that warm-up compiled
(draft positions are a static token bucket, so no graph per K or per draft count), drafts are
accepted on prompts whose JSON answer copies them, and greedy outputs are the same token for
token with speculation and without it (`disable_speculation`, same worker). One batch bucket
keeps warm-up short; token buckets 1 (decode), 16 (a verification row: 1 + 4 drafts + 8 forced
drafts) and 128 (prompts)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.support.processes import ServiceProcess, free_port, running
from tests.xla.support import chat, scrape

pytestmark = [pytest.mark.xla, pytest.mark.timeout(1800)]  # warm-up compiles for minutes

ARGS = [
    "--device", "xla", "--speculative", "ngram",
    "--max-batch-size", "2", "--batch-buckets", "2",
    "--max-seq-len", "256", "--seq-buckets", "256", "--token-buckets", "1,16,128",
]  # fmt: skip
RECORD = {
    "type": "object",
    "properties": {k: {"type": "string"} for k in ("name", "city", "workplace")},
    "required": ["name", "city", "workplace"],
    "additionalProperties": False,
}
PASSAGES = [
    "Maria Gonzalez lives in Valencia and works at the Riverside Public Library.",
    "Tomasz Nowak lives in Krakow and works at the Old Mill Bakery.",
]


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        args = [*ARGS, "--grammar-service", gs.address, "--metrics-port", str(port)]
        with running("worker", args, timeout_s=1500) as w:
            yield w, port


async def extract(address: str, passage: str, speculate: bool) -> worker_pb2.GenerateResponse:
    """The record of `passage` (greedy): the final message, with every token id of the stream."""
    req = worker_pb2.GenerateRequest(
        text=chat(f"{passage}\nGive the person's name, city and workplace as JSON."),
        sampling=worker_pb2.SamplingParams(max_tokens=48),
        disable_speculation=not speculate,
    )
    req.constraint.json_schema = json.dumps(RECORD)
    ids: list[int] = []
    text = ""
    async with grpc.aio.insecure_channel(address) as ch:
        async for msg in worker_pb2_grpc.WorkerStub(ch).Generate(req):
            ids += msg.token_ids
            text += msg.text
    msg.ClearField("token_ids")
    msg.token_ids.extend(ids)
    msg.text = text
    return msg


async def test_drafts_are_verified_on_warm_graphs_and_change_no_output(
    worker: tuple[ServiceProcess, int],
) -> None:
    w, port = worker
    before = scrape(port)
    on = await asyncio.gather(*(extract(w.address, p, True) for p in PASSAGES))
    off = await asyncio.gather(*(extract(w.address, p, False) for p in PASSAGES))
    after = scrape(port)

    new = (
        after["maskwire_worker_xla_compilations_total"]
        - before["maskwire_worker_xla_compilations_total"]
    )
    assert new == 0, f"{new} graphs compiled after warm-up:\n{w.log_text()[-3000:]}"
    for a, b in zip(on, off, strict=True):
        assert list(a.token_ids) == list(b.token_ids), (a.text, b.text)
        assert a.finish_reason == worker_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(a.text), RECORD)
        assert b.usage.draft_tokens == 0
    assert sum(a.usage.accepted_draft_tokens for a in on) > 0
    assert sum(a.usage.forward_passes for a in on) < sum(b.usage.forward_passes for b in off)
