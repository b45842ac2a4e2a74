"""Grammar client against in-process fake grammar services: placement, fan-out, replay, deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from maskwire.rpc import ACCEPTED_METADATA, RpcError
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from neuron_worker.config import GrammarSettings
from neuron_worker.grammar_client import GrammarClient, GrammarRequest

# The fixture's servers and the tests must share one event loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")

WORDS = 2
FP = common_pb2.TokenizerFingerprint(vocab_size=64, tokens_sha256=b"x", eos_token_ids=[0])


class FakeGrammar(grammar_pb2_grpc.GrammarServiceServicer):
    """Tracks positions like the real service. Mask row = [position, -1]; a request whose regex
    is "ff" gets ff_tokens [7, 8] on every step; "bad" fails to compile. The grammar_id of a
    regex is "g:" + the regex."""

    def __init__(self) -> None:
        self.opens: list[tuple[str, list[int]]] = []
        self.compiles: list[str] = []
        self.stall = False
        self.truncate_masks = False
        self.desync_once: set[str] = set()

    async def Compile(
        self, request: grammar_pb2.CompileRequest, context: grpc.aio.ServicerContext
    ) -> grammar_pb2.CompileResponse:
        await context.send_initial_metadata(ACCEPTED_METADATA)
        self.compiles.append(request.constraint.regex)
        if request.constraint.regex == "bad":
            await RpcError(
                grpc.StatusCode.INVALID_ARGUMENT, "bad regex", [("constraint.regex", "no")]
            ).abort(context)
        return grammar_pb2.CompileResponse(grammar_id="g:" + request.constraint.regex)

    async def Session(
        self,
        request_iterator: AsyncIterator[grammar_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[grammar_pb2.SessionResponse]:
        await context.send_initial_metadata(ACCEPTED_METADATA)
        live: dict[str, tuple[int, str]] = {}
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "open":
                o = msg.open
                live[o.request_id] = (len(o.replay_tokens), o.grammar_id.removeprefix("g:"))
                self.opens.append((o.request_id, list(o.replay_tokens)))
                yield grammar_pb2.SessionResponse(
                    opened=grammar_pb2.Opened(
                        request_id=o.request_id, position=len(o.replay_tokens)
                    )
                )
            elif kind == "step":
                if self.stall:
                    await asyncio.sleep(3600)
                rows, words = [], []
                for row in msg.step.rows:
                    if row.request_id not in live:
                        rows.append(
                            grammar_pb2.RowResult(
                                request_id=row.request_id,
                                status=grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST,
                            )
                        )
                        continue
                    pos, regex = live[row.request_id]
                    if row.request_id in self.desync_once:
                        self.desync_once.discard(row.request_id)
                        pos += 100
                        live[row.request_id] = (pos, regex)
                    if row.position != pos + len(row.new_tokens):
                        rows.append(
                            grammar_pb2.RowResult(
                                request_id=row.request_id,
                                status=grammar_pb2.ROW_STATUS_DESYNC,
                                expected_position=pos + len(row.new_tokens),
                            )
                        )
                        continue
                    ff = [7, 8] if regex == "ff" else []
                    pos = row.position + len(ff)
                    live[row.request_id] = (pos, regex)
                    words += [pos, -1]
                    rows.append(
                        grammar_pb2.RowResult(
                            request_id=row.request_id,
                            status=grammar_pb2.ROW_STATUS_OK,
                            mask_rows=1,
                            ff_tokens=ff,
                            position=pos,
                        )
                    )
                bitmask = b"".join(w.to_bytes(4, "little", signed=True) for w in words)
                if self.truncate_masks:
                    bitmask = bitmask[: -4 * WORDS]
                yield grammar_pb2.SessionResponse(
                    step_result=grammar_pb2.StepResult(
                        step=msg.step.step, rows=rows, bitmask=bitmask, words_per_row=WORDS
                    )
                )
            else:
                found = live.pop(msg.close.request_id, None) is not None
                yield grammar_pb2.SessionResponse(
                    closed=grammar_pb2.Closed(request_id=msg.close.request_id, found=found)
                )


class Replica:
    def __init__(self) -> None:
        self.fake = FakeGrammar()
        self.server = grpc.aio.server()
        grammar_pb2_grpc.add_GrammarServiceServicer_to_server(self.fake, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"


@pytest.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    reps = [Replica(), Replica()]
    for r in reps:
        await r.server.start()
    yield reps
    for r in reps:
        await r.server.stop(0)


def greq(i: int, regex: str = "x") -> GrammarRequest:
    return GrammarRequest(
        request_id=f"r{i}",
        constraint=common_pb2.Constraint(regex=regex),
        options=grammar_pb2.RequestOptions(),
    )


def client(addresses: list[str], **kw: float) -> GrammarClient:
    kw.setdefault("open_timeout_s", 10.0)
    settings = GrammarSettings(**kw)  # type: ignore[arg-type]
    return GrammarClient(addresses, FP, words_per_row=WORDS, settings=settings)


async def test_least_loaded_placement_and_ordered_fan_out(replicas: list[Replica]) -> None:
    c = client([r.address for r in replicas])
    reqs = [greq(i) for i in range(4)]
    for r in reqs:
        await c.open(r)
    assert sorted(len(rep.requests) for rep in c.replicas) == [2, 2]
    out = await c.step([(r, [5]) for r in reqs])
    assert all(o.ok for o in out)
    assert [int(o.mask[0, 0]) for o in out] == [1, 1, 1, 1]  # type: ignore[index]
    out = await c.step([(r, [5, 6]) for r in reqs[::-1]])
    assert [int(o.mask[0, 0]) for o in out] == [3, 3, 3, 3]  # type: ignore[index]
    assert all(r.consumed == [5, 5, 6] for r in reqs)
    await c.aclose()


async def test_concurrent_opens_spread_over_replicas(replicas: list[Replica]) -> None:
    # Opens in flight count as load: a burst must not all land on the replica that looked idle.
    c = client([r.address for r in replicas])
    await asyncio.gather(*(c.open(greq(i)) for i in range(4)))
    assert sorted(len(rep.requests) for rep in c.replicas) == [2, 2]
    await c.aclose()


async def test_forced_tokens_are_returned_and_counted(replicas: list[Replica]) -> None:
    c = client([replicas[0].address])
    r = greq(0, "ff")
    await c.open(r)
    (out,) = await c.step([(r, [])])
    assert out.ff_tokens == [7, 8] and r.consumed == [7, 8]
    (out,) = await c.step([(r, [3])])
    assert out.ok and r.consumed == [7, 8, 3, 7, 8]
    await c.aclose()


async def test_open_error_keeps_field_violations(replicas: list[Replica]) -> None:
    c = client([replicas[0].address])
    with pytest.raises(RpcError) as e:
        await c.open(greq(0, "bad"))
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.violations == (("constraint.regex", "no"),)
    await c.aclose()


async def test_broken_replica_requests_are_replayed_elsewhere(replicas: list[Replica]) -> None:
    c = client([r.address for r in replicas])
    reqs = [greq(i) for i in range(4)]
    for r in reqs:
        await c.open(r)
    await c.step([(r, [5]) for r in reqs])
    doomed = c.replicas[0]
    moved = {r.request_id for r in reqs if r.replica is doomed}
    survivor = next(rep for rep in replicas if rep.address != doomed.address)
    dead = next(rep for rep in replicas if rep.address == doomed.address)
    await dead.server.stop(0)
    out = await c.step([(r, [6]) for r in reqs])
    assert all(o.ok for o in out), [o.error for o in out]
    assert [int(o.mask[0, 0]) for o in out] == [2, 2, 2, 2]  # type: ignore[index]
    assert c.replays == 2
    replayed = {rid: toks for rid, toks in survivor.fake.opens if rid in moved}
    assert replayed == {rid: [5] for rid in moved}
    await c.aclose()


async def test_malformed_masks_break_the_replica_and_replay(replicas: list[Replica]) -> None:
    # A StepResult whose bitmask doesn't match its rows must never reach the sampler.
    c = client([r.address for r in replicas])
    a, b = greq(0), greq(1)
    await c.open(a)
    await c.open(b)
    bad = next(rep for rep in replicas if rep.address == a.replica.address)  # type: ignore[union-attr]
    bad.fake.truncate_masks = True
    out = await c.step([(a, [1]), (b, [1])])
    assert all(o.ok for o in out), [o.error for o in out]
    assert a.replica is b.replica  # a was re-opened on the healthy replica
    assert [int(o.mask[0, 0]) for o in out] == [1, 1]  # type: ignore[index]
    await c.aclose()


async def test_stalled_replica_fails_only_its_requests(replicas: list[Replica]) -> None:
    c = client([r.address for r in replicas], step_timeout_s=0.3)
    a, b = greq(0), greq(1)
    await c.open(a)
    await c.open(b)
    assert a.replica is not b.replica
    stalled = next(rep for rep in replicas if rep.address == a.replica.address)  # type: ignore[union-attr]
    stalled.fake.stall = True
    out = await c.step([(a, [1]), (b, [1])])
    assert not out[0].ok and out[0].code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not answer" in out[0].error
    assert out[1].ok
    await c.aclose()


async def test_desync_is_repaired_by_replay(replicas: list[Replica]) -> None:
    c = client([replicas[0].address])
    r = greq(0)
    await c.open(r)
    await c.step([(r, [4])])
    replicas[0].fake.desync_once.add("r0")
    (out,) = await c.step([(r, [5])])
    assert out.ok and r.consumed == [4, 5]
    assert replicas[0].fake.opens[-1] == ("r0", [4])
    await c.aclose()


async def test_no_reachable_replica_is_unavailable() -> None:
    from tests.support.processes import free_port

    c = client([f"127.0.0.1:{free_port()}"], open_timeout_s=5)
    with pytest.raises(RpcError) as e:
        await c.open(greq(0))
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    await c.aclose()
