"""The session state machine without gRPC."""

from __future__ import annotations

import pytest

from grammar_service.backend import LlgBackend
from grammar_service.compile_cache import CompileCache
from grammar_service.compile_pool import Compiler
from grammar_service.compiler import ParserLimits
from grammar_service.runtime import Limits, Runtime
from grammar_service.session import Session
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def runtime(tok: Tokenizer, max_requests: int = 8) -> Runtime:
    return Runtime(
        tokenizers=[tok],
        compiler=Compiler(limits=ParserLimits()),
        cache=CompileCache(16),
        backend=LlgBackend(2),
        limits=Limits(max_requests=max_requests),
    )


def open_msg(rid: str, tok: Tokenizer, regex: str = "[a-z]+") -> grammar_pb2.Open:
    return grammar_pb2.Open(
        request_id=rid,
        constraint=common_pb2.Constraint(regex=regex),
        tokenizer=tok.fingerprint.to_proto(),
    )


async def test_open_step_close_and_accounting(tok: Tokenizer) -> None:
    rt = runtime(tok, max_requests=2)
    s = Session(rt)
    assert not (await s.open(open_msg("a", tok))).HasField("error")
    assert not (await s.open(open_msg("b", tok))).HasField("error")
    full = await s.open(open_msg("c", tok))
    assert full.error.code == 8  # RESOURCE_EXHAUSTED
    t = tok.encode("abc")
    res = s.step(
        grammar_pb2.Step(
            step=7, rows=[grammar_pb2.StepRow(request_id="a", new_tokens=t, position=len(t))]
        )
    )
    assert (
        res.step == 7 and res.rows[0].status == grammar_pb2.ROW_STATUS_OK and res.rows[0].accepting
    )
    assert len(res.bitmask) == tok.words_per_row * 4
    assert s.close(grammar_pb2.Close(request_id="a")).found and rt.live_requests == 1
    assert s.close_all() == 1 and rt.live_requests == 0


async def test_step_before_any_open_reports_unknown(tok: Tokenizer) -> None:
    s = Session(runtime(tok))
    res = s.step(grammar_pb2.Step(step=1, rows=[grammar_pb2.StepRow(request_id="x")]))
    assert res.rows[0].status == grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST
    assert res.words_per_row == tok.words_per_row


async def test_open_requires_a_fingerprint(tok: Tokenizer) -> None:
    s = Session(runtime(tok))
    msg = open_msg("a", tok)
    msg.ClearField("tokenizer")
    opened = await s.open(msg)
    assert opened.error.code == 3 and "fingerprint" in opened.error.message
