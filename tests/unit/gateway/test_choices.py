"""`n` > 1 through the gateway, with the `openai` SDK against the in-process fake worker (whose
choices interleave): one choice per index, streamed with `index`, usage the OpenAI way, and the
`--max-n` limit."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import openai
import pytest

from tests.unit.gateway.fake_worker import MODEL, FakeWorkerServer, Reply
from tests.unit.gateway.test_app import USER, gateway, last, sdk

CHUNKS = ["Hel", "lo"]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


@pytest.fixture(scope="module")
def client(fake: FakeWorkerServer) -> Iterator[openai.OpenAI]:
    with gateway(workers=[fake.address], health_interval_s=0.5, max_n=4) as tc:
        yield sdk(tc)


@pytest.fixture(autouse=True)
def _reset(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=list(CHUNKS), prompt_tokens=7)


def test_chat_choices_and_usage(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, n=3, seed=11)
    assert last(fake).n == 3 and last(fake).sampling.seed == 11
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello" and c.finish_reason == "stop" for c in r.choices)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 3 * len(CHUNKS))
    assert r.usage.total_tokens == 7 + 3 * len(CHUNKS)


def test_chat_stream_has_an_index_per_choice(client: openai.OpenAI) -> None:
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=USER, n=2, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert dict(text) == {0: "Hello", 1: "Hello"}
    assert finish == {0: "stop", 1: "stop"}
    assert usage is not None and usage.prompt_tokens == 7 and usage.completion_tokens == 4


def test_completion_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="x", n=2, logprobs=0)
    assert [(c.index, c.text) for c in r.choices] == [(0, "Hello"), (1, "Hello")]
    assert all(c.logprobs is not None and c.logprobs.tokens == CHUNKS for c in r.choices)
    text: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(model=MODEL, prompt="x", n=2, stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
    assert dict(text) == {0: "Hello", 1: "Hello"}


def test_n_is_limited(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    before = len(fake.worker.requests)
    for create in (
        lambda: client.chat.completions.create(model=MODEL, messages=USER, n=5),
        lambda: client.completions.create(model=MODEL, prompt="x", n=5),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        body = e.value.body
        assert isinstance(body, dict) and body["param"] == "n" and "--max-n" in body["message"]
    assert len(fake.worker.requests) == before  # refused before the worker was called


def test_n_one_is_the_default(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, n=1)
    assert len(r.choices) == 1 and last(fake).n == 0
