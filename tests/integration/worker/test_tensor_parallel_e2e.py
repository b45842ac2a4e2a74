"""`maskwire worker --tensor-parallel-size 2` end to end: a real worker whose model, LM head and
mask are split over two ranks (rank 0 in the worker process, rank 1 a follower process it starts;
gloo on loopback), next to an unsharded worker, both on the embedded SmolLM2 in fp32 and one real
grammar service. Greedy outputs are token for token the unsharded worker's (constrained and not,
alone and in a mixed batch of 11, n = 2, penalties and logit bias, ignore_eos); logprobs agree;
seeded sampling draws what the sharded sampler draws at TP = 1; a killed rank makes the worker
NOT_SERVING and fails its requests with UNAVAILABLE, without a hang. Slow: three model copies
on two cores."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.tokenizer import load_tokenizer
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import Result, cases, channel, chat, generate
from tests.support.processes import ServiceProcess, running

pytestmark = pytest.mark.slow

FR = worker_pb2
CASES = cases()
FREE = ["The capital of France is", "Once upon a time", chat("Name three colors.")]


@pytest.fixture(scope="module")
def grammar() -> Iterator[ServiceProcess]:
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        yield gs


def _worker(grammar: ServiceProcess, tp: int) -> Any:
    args = ["--model", "default", "--grammar-service", grammar.address, "--max-batch-size", "8"]
    return running("worker", [*args, "--max-seq-len", "512", "--tensor-parallel-size", str(tp)])


@pytest.fixture(scope="module")
def workers(grammar: ServiceProcess) -> Iterator[dict[int, ServiceProcess]]:
    with _worker(grammar, 1) as one, _worker(grammar, 2) as two:
        yield {1: one, 2: two}


async def _both(workers: dict[int, ServiceProcess], fn: Any) -> dict[int, Any]:
    out = {}
    for tp, w in workers.items():
        async with channel(w.address) as ch:
            out[tp] = await fn(worker_pb2_grpc.WorkerStub(ch))
    return out


def _followers(worker: ServiceProcess) -> list[int]:
    """PIDs of the worker's rank processes (spawned children running `spawn_main`; any of the
    worker's threads may have started them)."""
    tasks = Path(f"/proc/{worker.proc.pid}/task")
    children = [c for t in tasks.iterdir() for c in (t / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_the_sharded_worker_runs_a_follower_rank(workers: dict[int, ServiceProcess]) -> None:
    assert len(_followers(workers[2])) == 1
    assert _followers(workers[1]) == []
    log = workers[2].log_text()
    assert "tensor parallel: 2 ranks" in log and "start=24576" in log


async def test_greedy_c1_equals_the_unsharded_worker(workers: dict[int, ServiceProcess]) -> None:
    async def run(stub: worker_pb2_grpc.WorkerStub) -> list[Result]:
        out = [await generate(stub, c.prompt, c.constraint) for c in CASES]
        out += [await generate(stub, p, max_tokens=24) for p in FREE]
        out.append(await generate(stub, chat("Say OK."), max_tokens=12, ignore_eos=True))
        return out

    got = await _both(workers, run)
    for case, r in zip(CASES, got[2], strict=False):
        assert r.final.finish_reason == FR.FINISH_REASON_STOP, (case.name, r.text)
        case.check(r.text, r.ids)
    assert got[2][-1].final.finish_reason == FR.FINISH_REASON_LENGTH  # EOS banned on its rank
    assert len(got[2][-1].ids) == 12
    assert [r.ids for r in got[2]] == [r.ids for r in got[1]]
    assert [r.text for r in got[2]] == [r.text for r in got[1]]


async def test_greedy_c8_mixed_batch_equals_the_unsharded_worker(
    workers: dict[int, ServiceProcess],
) -> None:
    batch = CASES + CASES[:1]  # 8 constrained requests and 3 unconstrained ones at once

    async def run(stub: worker_pb2_grpc.WorkerStub) -> list[Result]:
        constrained = [generate(stub, c.prompt, c.constraint) for c in batch]
        free = [generate(stub, p, max_tokens=16) for p in FREE]
        return list(await asyncio.gather(*constrained, *free))

    got = await _both(workers, run)
    for case, r in zip(batch, got[2], strict=False):
        case.check(r.text, r.ids)
    assert [r.ids for r in got[2]] == [r.ids for r in got[1]]


async def test_n2_penalties_bias_and_logprobs_equal_the_unsharded_worker(
    workers: dict[int, ServiceProcess],
) -> None:
    tok = load_tokenizer("default")
    banned = tok.encode(" Paris")[0]  # rank 0's slice
    high = 40_000  # rank 1's slice: pushed up, then penalised once it occurs

    async def run(stub: worker_pb2_grpc.WorkerStub) -> tuple[Any, ...]:
        penalised = await generate(
            stub,
            "The capital of France is",
            max_tokens=12,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias={banned: -100.0, high: 4.0},
        )
        logprobs = await generate(
            stub, CASES[0].prompt, CASES[0].constraint, logprobs=True, top_logprobs=5
        )
        raw = await generate(
            stub,
            "Once upon a time",
            max_tokens=6,
            logprobs=True,
            top_logprobs=3,
            logprobs_mode=worker_pb2.LOGPROBS_MODE_RAW,
        )
        choices = [
            [msg async for msg in stub.Generate(_n2_request(c))] for c in (CASES[0], CASES[4])
        ]
        return penalised, logprobs, raw, choices

    got = await _both(workers, run)
    one, two = got[1], got[2]
    assert banned not in two[0].ids
    assert two[0].ids == one[0].ids
    for r1, r2 in zip(one[1:3], two[1:3], strict=True):
        assert r2.ids == r1.ids
        lp1, lp2 = _logprobs(r1), _logprobs(r2)
        assert len(lp2) == len(r2.ids)
        for a, b in zip(lp1, lp2, strict=True):
            assert b[0] == a[0] and abs(b[1] - a[1]) < 1e-3
            assert [t for t, _ in b[2]] == [t for t, _ in a[2]]
            assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(a[2], b[2], strict=True))
    for msgs1, msgs2 in zip(one[3], two[3], strict=True):
        ids1, ids2 = _by_choice(msgs1), _by_choice(msgs2)
        assert ids2 == ids1 and len(ids2) == 2 and ids2[0] == ids2[1]


def _n2_request(case: Any) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(
        text=case.prompt, n=2, sampling=worker_pb2.SamplingParams(max_tokens=32)
    )
    req.constraint.CopyFrom(case.constraint)
    return req


def _by_choice(msgs: list[worker_pb2.GenerateResponse]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


def _logprobs(r: Any) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Each generated token's (id, logprob, top alternatives), from every chunk of a result."""
    out = []
    for msg in r.messages:
        for lp in msg.logprobs:
            top = [(t.token_id, t.logprob) for t in lp.top_logprobs]
            out.append((lp.token_id, lp.logprob, top))
    return out


async def test_seeded_sampling_draws_what_the_sharded_sampler_draws_at_tp1(
    workers: dict[int, ServiceProcess],
) -> None:
    from neuron_worker.model import load_model
    from neuron_worker.parallel import ShardedSampler, SingleRank, shard_transformer
    from neuron_worker.parallel.decode import sample_generate
    from neuron_worker.parallel.runner import RankRunner

    tok = load_tokenizer("default")
    prompt = tok.encode(chat("Tell me a fact about cats."))

    async def run(stub: worker_pb2_grpc.WorkerStub) -> list[list[int]]:
        out = []
        for _ in range(2):
            req = worker_pb2.GenerateRequest(
                token_ids=worker_pb2.TokenIds(ids=prompt),
                sampling=worker_pb2.SamplingParams(
                    temperature=0.9, top_p=0.95, seed=11, max_tokens=16
                ),
            )
            out.append([t async for msg in stub.Generate(req) for t in msg.token_ids])
        return out

    async with channel(workers[2].address) as ch:
        twice = await run(worker_pb2_grpc.WorkerStub(ch))
    assert twice[0] == twice[1] and len(twice[0]) > 4

    model = load_model("default")
    group = SingleRank()
    shard = shard_transformer(model, group)
    model.setup_caches(1, 256)
    runner = RankRunner(model, ShardedSampler(shard=shard, vocab_size=tok.vocab_size, group=group))
    expected = sample_generate(
        runner, prompt, 16, temperature=0.9, top_p=0.95, seed=11, stop_ids=tok.eos_token_ids
    )
    if expected and expected[-1] in tok.eos_token_ids:
        expected = expected[:-1]  # the worker ends at EOS without emitting it
    assert twice[0] == expected


def _health(address: str) -> int:
    import grpc as sync_grpc

    with sync_grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return int(resp.status)


async def test_a_killed_rank_makes_the_worker_unready_and_fails_requests_unavailable(
    grammar: ServiceProcess,
) -> None:
    with _worker(grammar, 2) as w:
        assert _health(w.address) == health_pb2.HealthCheckResponse.SERVING
        async with channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            long = worker_pb2.GenerateRequest(
                text="Once upon a time",
                sampling=worker_pb2.SamplingParams(max_tokens=400, ignore_eos=True),
            )
            call = stub.Generate(long)
            first = await call.read()  # the request is running
            assert first.token_ids
            (follower,) = _followers(w)
            os.kill(follower, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rank 1" in (e.value.details() or "")
            while _health(w.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() - killed < 5, "still SERVING 5 s after a rank died"
                await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(stub, "Hello", max_tokens=4)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert w.proc.poll() is None  # unready, not crashed or hung: health still answers
        assert w.stop() == 0
