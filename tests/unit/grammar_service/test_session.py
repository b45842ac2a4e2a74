"""The session state machine without gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from grammar_service.backend import LlgBackend
from grammar_service.compile_cache import CompileCache
from grammar_service.compile_pool import Compiler
from grammar_service.config import Limits, ParserLimits
from grammar_service.runtime import Runtime
from grammar_service.session import Session
from maskwire.rpc import RpcError
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


async def test_one_stream_holds_at_most_its_share(tok: Tokenizer) -> None:
    rt = runtime(tok)
    rt.limits = Limits(max_requests=8, max_requests_per_stream=2)
    greedy, other = Session(rt), Session(rt)
    # Sent at once: Opens still compiling count towards their stream's share.
    answers = await asyncio.gather(
        *(greedy.open(open_msg(f"g{i}", tok, f"[a-z]{{{i + 1}}}")) for i in range(4))
    )
    refused = [RpcError.from_status(a.error) for a in answers if a.HasField("error")]
    assert [e.reason for e in refused] == ["TOO_MANY_STREAM_REQUESTS"] * 2
    assert all(e.code is grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert "--max-requests-per-stream 2" in refused[0].message
    assert len(greedy.requests) == 2 and rt.live_requests == 2
    for i in range(2):
        assert not (await other.open(open_msg(f"o{i}", tok))).HasField("error")
    assert greedy.close_all() == 2
    assert not (await greedy.open(open_msg("again", tok))).HasField("error")


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


AMBIGUOUS = 's: s s s | s s | "a" | ""\nstart: s'


def lark_open(
    rid: str, tok: Tokenizer, lark: str, replay: list[int] | None = None
) -> grammar_pb2.Open:
    return grammar_pb2.Open(
        request_id=rid,
        constraint=common_pb2.Constraint(lark=lark),
        tokenizer=tok.fingerprint.to_proto(),
        replay_tokens=replay or [],
    )


@pytest.mark.parametrize("rows", [3, 12])  # row by row, and through the batched executor calls
async def test_a_request_past_its_step_budget_fails_and_the_others_go_on(
    tok: Tokenizer, rows: int
) -> None:
    """An ambiguous grammar's parser work grows with every token; past the per-request budget
    that request fails with GRAMMAR_TOO_EXPENSIVE while a cheap one on the same stream goes on."""
    rt = runtime(tok, max_requests=32)
    rt.limits = Limits(max_requests=32, max_request_step_s=0.005)
    s = Session(rt)
    a = tok.encode("a")
    expensive = [f"amb{i}" for i in range(rows - 1)]
    for rid in expensive:
        assert not (await s.open(lark_open(rid, tok, AMBIGUOUS))).HasField("error")
    assert not (await s.open(open_msg("cheap", tok, "a*"))).HasField("error")
    live = [*expensive, "cheap"]
    pos = dict.fromkeys(live, 0)
    failed: dict[str, str] = {}
    for step in range(1, 400):
        rs = []
        for rid in live:
            pos[rid] += 1
            rs.append(grammar_pb2.StepRow(request_id=rid, new_tokens=a, position=pos[rid]))
        res = s.step(grammar_pb2.Step(step=step, rows=rs))
        for row in res.rows:
            if row.status != grammar_pb2.ROW_STATUS_OK:
                failed[row.request_id] = row.error.message
        live = [rid for rid in live if rid not in failed]
        if live == ["cheap"]:
            break
    assert set(failed) == set(expensive)
    assert all("--max-request-step-ms" in m for m in failed.values()), failed
    last = s.step(
        grammar_pb2.Step(
            step=999,
            rows=[grammar_pb2.StepRow(request_id="cheap", new_tokens=a, position=pos["cheap"] + 1)],
        )
    )
    assert last.rows[0].status == grammar_pb2.ROW_STATUS_OK and last.rows[0].accepting


async def test_a_replay_past_its_budget_is_refused(tok: Tokenizer) -> None:
    rt = runtime(tok)
    rt.limits = Limits(max_replay_s=0.05)
    s = Session(rt)
    opened = await s.open(lark_open("r", tok, AMBIGUOUS, tok.encode("a") * 400))
    assert opened.error.code == 3  # INVALID_ARGUMENT
    assert "--max-replay-ms" in opened.error.message
    assert rt.live_requests == 0


async def test_concurrent_duplicate_open_is_refused_after_the_compile(tok: Tokenizer) -> None:
    """Two Opens of one id racing on a stream: both pass the first check while the grammar
    compiles (off the event loop); the re-check after the compile refuses the second with the
    same answer as the first check (ALREADY_EXISTS, DUPLICATE_REQUEST) and frees its slot."""
    rt = runtime(tok)
    s = Session(rt)
    # A constraint the fresh runtime has never compiled: both Opens wait for the compile.
    first, second = await asyncio.gather(
        s.open(open_msg("dup", tok, "[a-c]{2,9}")), s.open(open_msg("dup", tok, "[a-c]{2,9}"))
    )
    assert not first.HasField("error"), first.error
    err = RpcError.from_status(second.error)
    assert err.code is grpc.StatusCode.ALREADY_EXISTS, err.message
    assert err.reason == "DUPLICATE_REQUEST"
    assert list(err.violations) == [("open.request_id", "duplicate of a live request")]
    assert list(s.requests) == ["dup"] and rt.live_requests == 1
    # The one that was opened works and is closed once.
    t = tok.encode("ab")
    res = s.step(
        grammar_pb2.Step(
            step=1, rows=[grammar_pb2.StepRow(request_id="dup", new_tokens=t, position=len(t))]
        )
    )
    assert res.rows[0].status == grammar_pb2.ROW_STATUS_OK and res.rows[0].accepting
    assert s.close(grammar_pb2.Close(request_id="dup")).found and rt.live_requests == 0
    assert not s.close(grammar_pb2.Close(request_id="dup")).found


async def test_max_rows_per_step_limit(tok: Tokenizer) -> None:
    s = Session(
        Runtime(
            tokenizers=[tok],
            compiler=Compiler(limits=ParserLimits()),
            cache=CompileCache(16),
            backend=LlgBackend(2),
            limits=Limits(max_rows_per_step=2),
        )
    )
    assert not (await s.open(open_msg("a", tok))).HasField("error")
    rows = [grammar_pb2.StepRow(request_id="a"), grammar_pb2.StepRow(request_id="ghost")]
    assert len(s.step(grammar_pb2.Step(step=1, rows=rows)).rows) == 2
    with pytest.raises(RpcError) as e:
        s.step(grammar_pb2.Step(step=2, rows=[*rows, grammar_pb2.StepRow(request_id="b")]))
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-rows-per-step" in e.value.message
