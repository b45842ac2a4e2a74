"""One Session stream cannot take every live-request slot of a grammar service
(`--max-requests-per-stream`): its extra Opens are refused one by one, its stream and requests go
on, and another stream and a real worker still open and serve theirs."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.grammar_service.client import SessionClient, channel, masks, row, text_tokens
from tests.support.processes import ServiceProcess, grammar_and_worker

MAX_REQUESTS = 16
PER_STREAM = 6
YES_NO = common_pb2.Constraint(regex="(yes|no)")


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    grammar_args = [
        *("--max-requests", str(MAX_REQUESTS)),
        *("--max-requests-per-stream", str(PER_STREAM)),
    ]
    with grammar_and_worker(["--max-seq-len", "256"], grammar_args) as (gs, w):
        yield gs, w


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def _step_ok(client: SessionClient, tok: Tokenizer, rid: str) -> None:
    """`rid` consumes "yes" and is accepting: its request is served."""
    yes = text_tokens(tok, "yes")
    res = client.step([row(rid, len(yes), yes)])
    assert res.rows[0].status == 1 and res.rows[0].accepting, res.rows[0]  # ROW_STATUS_OK
    assert masks(res).shape[0] == 1


def _generate(worker: ServiceProcess) -> worker_pb2.GenerateResponse:
    with grpc.insecure_channel(worker.address) as ch:
        req = worker_pb2.GenerateRequest(
            text="Is the sky blue? Answer yes or no.",
            sampling=worker_pb2.SamplingParams(max_tokens=4, temperature=0),
            constraint=YES_NO,
        )
        msgs = list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=120))
    text = "".join(m.text for m in msgs)
    assert text in ("yes", "no") and msgs[-1].finish_reason == worker_pb2.FINISH_REASON_STOP, msgs
    return msgs[-1]


def test_one_stream_takes_its_share_and_the_others_are_served(
    services: tuple[ServiceProcess, ServiceProcess], tok: Tokenizer
) -> None:
    gs, worker = services
    with channel(gs.address) as ch_greedy, channel(gs.address) as ch_other:
        greedy = SessionClient(ch_greedy)
        # As many as the whole service holds, and one more.
        answers = [greedy.open(f"g{i}", tok, YES_NO) for i in range(MAX_REQUESTS + 1)]
        opened = [a for a in answers if not a.HasField("error")]
        refused = [RpcError.from_status(a.error) for a in answers if a.HasField("error")]
        assert len(opened) == PER_STREAM, [e.message for e in refused]
        assert len(refused) == MAX_REQUESTS + 1 - PER_STREAM
        for err in refused:
            assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED, err.message
            assert err.reason == "TOO_MANY_STREAM_REQUESTS"
            assert "--max-requests-per-stream 6" in err.message
        # The greedy stream itself goes on: its requests are served, a closed one frees a slot.
        _step_ok(greedy, tok, "g0")
        assert greedy.close("g1").found
        assert not greedy.open("again", tok, YES_NO).HasField("error")

        # Another stream (another client) gets every request of its own share.
        other = SessionClient(ch_other)
        for i in range(PER_STREAM):
            assert not other.open(f"o{i}", tok, YES_NO).HasField("error")
        _step_ok(other, tok, "o0")

        # And the worker's own stream still opens and serves constrained requests.
        _generate(worker)
        _generate(worker)
        greedy.end()
        other.end()
