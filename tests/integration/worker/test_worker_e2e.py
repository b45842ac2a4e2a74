"""End to end: a real grammar service and a real worker (embedded SmolLM2) over gRPC."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import SCHEMAS, Case, cases, channel, chat, generate
from tests.support.processes import TEST_WORKER_DEVICE, ServiceProcess, running

FR = worker_pb2


@pytest.fixture(scope="module")
def grammar_service() -> Iterator[ServiceProcess]:
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        yield gs


@pytest.fixture(scope="module")
def worker(grammar_service: ServiceProcess) -> Iterator[ServiceProcess]:
    args = ["--model", "default", "--grammar-service", grammar_service.address]
    with running("worker", [*args, "--max-batch-size", "8", "--max-seq-len", "512"]) as w:
        yield w


CASES = cases()


async def test_model_info(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        info = await worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.GetModelInfoRequest())
    assert info.model == "SmolLM2-135M-Instruct"
    assert info.vocab_size == 49152 and info.logits_size >= info.vocab_size
    assert info.max_context == 512 and info.max_batch_size == 8
    assert list(info.eos_token_ids) == [2] and info.eos_token == "<|im_end|>"
    assert "<|im_start|>" in info.chat_template
    assert info.structured_outputs and info.device == TEST_WORKER_DEVICE
    assert info.tokenizer.vocab_size == 49152 and len(info.tokenizer.tokens_sha256) == 32


async def test_unconstrained_greedy_and_stop_string(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        r = await generate(stub, "The capital of France is", max_tokens=3)
        assert r.text.startswith(" Paris")
        assert r.final.finish_reason == FR.FINISH_REASON_LENGTH
        assert r.final.usage.prompt_tokens == 5 and r.final.usage.completion_tokens == 3
        assert len(r.ids) == 3
        r = await generate(stub, "The capital of France is", max_tokens=8, stop=["."])
        assert r.text == " Paris"
        assert r.final.finish_reason == FR.FINISH_REASON_STOP_STRING and r.final.stop_string == "."


async def test_eos_and_ignore_eos(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        r = await generate(stub, chat("Say OK."), max_tokens=40)
        assert r.final.finish_reason == FR.FINISH_REASON_STOP
        n = r.final.usage.completion_tokens
        r = await generate(stub, chat("Say OK."), max_tokens=n + 3, ignore_eos=True)
        assert r.final.finish_reason == FR.FINISH_REASON_LENGTH
        assert r.final.usage.completion_tokens == n + 3


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_constrained_concurrency_1(worker: ServiceProcess, case: Case) -> None:
    async with channel(worker.address) as ch:
        r = await generate(worker_pb2_grpc.WorkerStub(ch), case.prompt, case.constraint)
    assert r.final.finish_reason == FR.FINISH_REASON_STOP, r.text
    case.check(r.text, r.ids)
    assert r.final.usage.completion_tokens == len(r.ids)
    usage = r.final.usage
    # One pass per sampled token plus the one that finds the end; forced tokens share passes.
    assert usage.forward_passes <= usage.completion_tokens + 1
    if case.name.startswith("schema"):
        assert usage.forced_tokens > 0 and usage.forward_passes < usage.completion_tokens


async def test_constrained_concurrency_8_mixed_with_unconstrained(worker: ServiceProcess) -> None:
    batch = CASES + CASES[:1]  # 8 constrained requests
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        constrained = [generate(stub, c.prompt, c.constraint) for c in batch]
        free = [generate(stub, "The capital of France is", max_tokens=4) for _ in range(3)]
        results = await asyncio.gather(*constrained, *free)
    for case, r in zip(batch, results, strict=False):
        assert r.final.finish_reason == FR.FINISH_REASON_STOP, (case.name, r.text)
        case.check(r.text, r.ids)
    for r in results[len(batch) :]:
        assert r.text.startswith(" Paris") and r.final.finish_reason == FR.FINISH_REASON_LENGTH


async def test_max_tokens_inside_structure_is_length(worker: ServiceProcess) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    async with channel(worker.address) as ch:
        r = await generate(
            worker_pb2_grpc.WorkerStub(ch),
            chat("Tell a long story as JSON."),
            common_pb2.Constraint(json_schema=json.dumps(schema)),
            max_tokens=8,
        )
    assert r.final.finish_reason == FR.FINISH_REASON_LENGTH
    assert r.final.usage.completion_tokens == 8 and r.text.startswith('{"story": "')


async def _error(stub: worker_pb2_grpc.WorkerStub, req: worker_pb2.GenerateRequest) -> RpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Generate(req):
            pass
    return RpcError.from_call_error(e.value)


async def test_request_errors(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        bad_schema = worker_pb2.GenerateRequest(
            text="x", constraint=common_pb2.Constraint(json_schema='{"type": "objekt"}')
        )
        err = await _error(stub, bad_schema)
        assert err.code is grpc.StatusCode.INVALID_ARGUMENT and err.violations
        err = await _error(stub, worker_pb2.GenerateRequest(text="x", model="gpt-9"))
        assert err.code is grpc.StatusCode.NOT_FOUND
        err = await _error(stub, worker_pb2.GenerateRequest(text="hello " * 600))
        assert err.code is grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in err.violations] == ["prompt"]
        err = await _error(
            stub,
            worker_pb2.GenerateRequest(
                text="x", sampling=worker_pb2.SamplingParams(temperature=5.0, top_p=2.0)
            ),
        )
        assert {f for f, _ in err.violations} == {"sampling.temperature", "sampling.top_p"}
        err = await _error(stub, worker_pb2.GenerateRequest())
        assert err.code is grpc.StatusCode.INVALID_ARGUMENT


async def test_abort_and_cancellation_free_the_request(worker: ServiceProcess) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        long = worker_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
        # Abort: the stream ends with ABORT.
        call = stub.Generate(
            worker_pb2.GenerateRequest(request_id="to-abort", text="Hi", sampling=long)
        )
        first = await call.read()
        assert first.request_id == "to-abort"
        assert (await stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"))).found
        last = first
        while (msg := await call.read()) is not grpc.aio.EOF:
            last = msg
        assert last.finish_reason == FR.FINISH_REASON_ABORT
        # Cancellation: the worker drops the request (Abort no longer finds it).
        schema = json.dumps(SCHEMAS["person"])
        call = stub.Generate(
            worker_pb2.GenerateRequest(
                request_id="to-cancel",
                text="Hi",
                sampling=long,
            )
        )
        await call.read()
        call.cancel()
        for _ in range(200):
            if not (await stub.Abort(worker_pb2.AbortRequest(request_id="to-cancel"))).found:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("cancelled request still live")
        # The worker keeps serving, constrained included.
        r = await generate(stub, chat("A person?"), common_pb2.Constraint(json_schema=schema))
        assert r.final.finish_reason == FR.FINISH_REASON_STOP
