"""Logprobs, penalties and logit bias through the gateway, with the `openai` SDK against the
in-process fake worker: what reaches the worker, and OpenAI's response shapes."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.logprobs import CompletionLogprobs, token_text
from maskwire.v1 import worker_pb2
from tests.unit.gateway.fake_worker import MODEL, FakeWorkerServer, Reply
from tests.unit.gateway.test_app import USER, gateway, last, sdk


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


@pytest.fixture(scope="module")
def client(fake: FakeWorkerServer) -> Iterator[openai.OpenAI]:
    with gateway(workers=[fake.address], health_interval_s=0.5) as tc:
        yield sdk(tc)


@pytest.fixture(autouse=True)
def _reset(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["Hel", "lo", " w"])


def test_penalties_and_bias_reach_the_worker(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    client.chat.completions.create(
        model=MODEL,
        messages=USER,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias={"42": -100, "7": 2.5},
        extra_body={"repetition_penalty": 1.2},
    )
    s = last(fake).sampling
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -1.0
    assert s.repetition_penalty == pytest.approx(1.2)
    assert dict(s.logit_bias) == {42: -100.0, 7: 2.5}
    assert not s.logprobs


def test_chat_logprobs_shape(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2)
    s = last(fake).sampling
    assert s.logprobs and s.top_logprobs == 2
    assert s.logprobs_mode == worker_pb2.LOGPROBS_MODE_PROCESSED
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [c.token for c in content] == ["Hel", "lo", " w"]
    assert [c.logprob for c in content] == [-0.5, 0.0, -1.5]
    assert [c.bytes for c in content] == [list(b"Hel"), list(b"lo"), list(b" w")]
    assert [c.model_extra["forced"] for c in content] == [False, True, False]  # type: ignore[index]
    assert [t.token for t in content[0].top_logprobs] == ["t0", "t1"]
    assert content[0].top_logprobs[1].logprob == -1.25


def test_chat_logprobs_streamed(client: openai.OpenAI, fake: FakeWorkerServer) -> None:
    tokens = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=USER,
        logprobs=True,
        stream=True,
        extra_body={"logprobs_mode": "raw"},
    ):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                tokens += [(t.token, t.logprob, t.top_logprobs) for t in c.logprobs.content]
    assert last(fake).sampling.logprobs_mode == worker_pb2.LOGPROBS_MODE_RAW
    assert tokens == [("Hel", -0.5, []), ("lo", 0.0, []), (" w", -1.5, [])]


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="x", logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["Hel", "lo", " w"]
    assert lp.token_logprobs == [-0.5, 0.0, -1.5]
    assert lp.top_logprobs == [{"t0": -0.25}] * 3
    assert lp.text_offset == [0, 3, 5]
    assert lp.model_extra["forced"] == [False, True, False]  # type: ignore[index]


def test_completion_logprobs_streamed(client: openai.OpenAI) -> None:
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in client.completions.create(model=MODEL, prompt="x", logprobs=0, stream=True):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            tokens += lp.tokens or []
            offsets += lp.text_offset or []
    assert tokens == ["Hel", "lo", " w"] and offsets == [0, 3, 5]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1, "echo": True}, "echo"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_completion_refusals_name_the_field(
    client: openai.OpenAI, kw: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", **kw)  # type: ignore[call-overload]
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


def test_partial_characters_and_offsets() -> None:
    assert token_text("é".encode()[:1]) == "bytes:\\xc3"
    offsets = CompletionLogprobs(start=2)
    part = offsets.add(
        [
            worker_pb2.TokenLogprob(token=b"a"),
            worker_pb2.TokenLogprob(token="é".encode()[:1]),
            worker_pb2.TokenLogprob(token="é".encode()[1:]),
            worker_pb2.TokenLogprob(token=b"b"),
        ]
    )
    assert part["text_offset"] == [2, 3, 3, 4]
