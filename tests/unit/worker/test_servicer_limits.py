"""The worker's request validation is bounded by its limits, not by what was sent: prompts are
measured before they are tokenized, tokenized off the event loop, and repeated fields counted
before they are read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.tokenizer import load_tokenizer
from maskwire.v1 import worker_pb2
from neuron_worker.config import PromptLimits
from neuron_worker.servicer import MAX_CACHE_SALT_CHARS, MAX_REQUEST_ID_CHARS, WorkerServicer

TOK = load_tokenizer("default")
MAX_SEQ = 256


class CountingTokenizer:
    """The real tokenizer, counting how many prompts it was asked to encode."""

    def __init__(self) -> None:
        self.encoded = 0
        self.vocab_size = TOK.vocab_size
        self.token_bytes = TOK.token_bytes

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return TOK.encode(text)


@pytest.fixture
def servicer() -> Iterator[WorkerServicer]:
    engine: Any = SimpleNamespace(config=SimpleNamespace(max_seq_len=MAX_SEQ, max_batch=4))
    s = WorkerServicer(
        engine,
        CountingTokenizer(),  # type: ignore[arg-type]
        model_name="m",
        device="cpu",
        # The token limit is the context less one (`--max-prompt-tokens 0`).
        limits=PromptLimits(max_prompt_bytes=64 * 1024, tokenizer_threads=1),
    )
    yield s
    s.close()


def encoded(s: WorkerServicer) -> int:
    return s.tokenizer.encoded  # type: ignore[attr-defined, no-any-return]


async def refused(s: WorkerServicer, msg: worker_pb2.GenerateRequest) -> RpcError:
    with pytest.raises(RpcError) as e:
        await s._build(msg)
    return e.value


def gen(**kw: Any) -> worker_pb2.GenerateRequest:
    sampling = worker_pb2.SamplingParams(max_tokens=2, **kw.pop("sampling", {}))
    kw.setdefault("text", "Hi")
    return worker_pb2.GenerateRequest(sampling=sampling, **kw)


async def test_a_valid_request_is_tokenized(servicer: WorkerServicer) -> None:
    req = await servicer._build(gen(text="The capital of France is"))
    assert req.prompt == TOK.encode("The capital of France is") and encoded(servicer) == 1


async def test_text_over_max_prompt_bytes_is_refused_before_tokenizing(
    servicer: WorkerServicer,
) -> None:
    err = await refused(servicer, gen(text="é" * 40_000))  # 80,000 bytes
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.violations[0][0] == "prompt" and "80000 bytes" in err.violations[0][1]
    assert "--max-prompt-bytes" in err.violations[0][1]
    assert encoded(servicer) == 0


async def test_no_tokenizing_when_another_field_is_invalid(servicer: WorkerServicer) -> None:
    err = await refused(servicer, gen(text="hello " * 1000, sampling={"temperature": 9}))
    assert err.violations == (("sampling.temperature", "must be in [0, 2]"),)
    assert encoded(servicer) == 0


async def test_token_ids_are_counted_before_they_are_read(servicer: WorkerServicer) -> None:
    many = worker_pb2.GenerateRequest(token_ids=worker_pb2.TokenIds(ids=[-1] * 1_000_000))
    err = await refused(servicer, many)
    assert err.violations[0][0] == "prompt" and "1000000 tokens" in err.violations[0][1]
    err = await refused(
        servicer, worker_pb2.GenerateRequest(token_ids=worker_pb2.TokenIds(ids=[2**31 - 1]))
    )
    assert err.violations[0][0] == "token_ids.ids"


async def test_huge_repeated_and_string_fields(servicer: WorkerServicer) -> None:
    err = await refused(servicer, gen(sampling={"stop_token_ids": [1] * (TOK.vocab_size + 1)}))
    assert err.violations[0][0] == "sampling.stop_token_ids"
    err = await refused(servicer, gen(request_id="r" * (MAX_REQUEST_ID_CHARS + 1)))
    assert err.violations[0][0] == "request_id"
    await servicer._build(gen(request_id="r" * MAX_REQUEST_ID_CHARS))
    err = await refused(servicer, gen(request_id="x/0"))  # the worker's name for a choice
    assert err.violations[0][0] == "request_id" and "'/'" in err.violations[0][1]
    for forged in ("a\nINFO fake log line", "a\x00b", "tab\there", "bidi\u202e"):
        err = await refused(servicer, gen(request_id=forged))
        assert err.violations[0][0] == "request_id" and "unprintable" in err.violations[0][1]
    await servicer._build(gen(request_id="chatcmpl-0f3e:ok.id_1 ü"))
    assert (await servicer._build(gen())).request_id  # empty: the worker assigns one
    err = await refused(servicer, gen(cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1)))
    assert err.violations[0][0] == "cache_salt"
    assert (await servicer._build(gen(cache_salt="tenant-1"))).cache_salt == "tenant-1"
    err = await refused(servicer, gen(model="m" * 5_000_000))
    assert err.code is grpc.StatusCode.NOT_FOUND and len(err.message) < 1000


async def test_tokenizing_leaves_the_event_loop_free(servicer: WorkerServicer) -> None:
    """Health checks and streams are served while a long prompt is tokenized."""
    servicer.max_prompt_bytes = 2 * 1024 * 1024
    text = "hello world, this is a test. " * 60_000  # 1.7 MB, about a second to tokenize
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        err = await refused(servicer, gen(text=text))
        took = time.perf_counter() - t0
    finally:
        tick.cancel()
    assert err.violations[0][0] == "prompt" and "tokens" in err.violations[0][1]
    assert took > 0.2, "too quick to tell anything"
    # Tokenizing on the loop would block it for about `took`; a loaded machine adds some lag.
    bound = max(0.25, took / 2)
    assert max(gaps) < bound, f"event loop blocked {max(gaps):.2f}s of {took:.2f}s"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"n": 5}, "n"),
        ({"sampling": {"presence_penalty": 2.5}}, "sampling.presence_penalty"),
        ({"sampling": {"repetition_penalty": 3.0}}, "sampling.repetition_penalty"),
        ({"sampling": {"logit_bias": {TOK.vocab_size: 1.0}}}, "sampling.logit_bias"),
        ({"sampling": {"logit_bias": {5: 101.0}}}, "sampling.logit_bias"),
        ({"sampling": {"logit_bias": {i: 1.0 for i in range(301)}}}, "sampling.logit_bias"),
        ({"sampling": {"logprobs": True, "top_logprobs": 21}}, "sampling.top_logprobs"),
        ({"sampling": {"top_logprobs": 2}}, "sampling.top_logprobs"),
    ],
)
async def test_sampling_extras_out_of_range_are_refused(
    servicer: WorkerServicer, kw: dict[str, Any], field: str
) -> None:
    err = await refused(servicer, gen(**kw))
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v[0] for v in err.violations] == [field]
    assert encoded(servicer) == 0
