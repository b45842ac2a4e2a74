"""Property-based test of the grammar service's Session protocol: random sequences of Open / Step /
Close / disconnect against a real service process, each answer checked against a Python model of
the protocol (live requests per stream, positions, row statuses, Close's `found`), and the
service's live-request gauge checked against the model (a disconnect frees everything)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from tests.integration.grammar_service.client import SessionClient, channel, row
from tests.support.processes import ServiceProcess, free_port, running

OK = grammar_pb2.ROW_STATUS_OK
DESYNC = grammar_pb2.ROW_STATUS_DESYNC
ERROR = grammar_pb2.ROW_STATUS_ERROR
UNKNOWN = grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST

CONSTRAINT = common_pb2.Constraint(regex="(ab)*")
IDS = ["a", "b", "c"]
BAD_RANGE = -1  # marker: an out-of-range token id
BAD_GRAMMAR = -2  # marker: a valid id the grammar rejects


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def service() -> Iterator[ServiceProcess]:
    port = free_port()
    with running("grammar-service", ["--tokenizer", "default", "--metrics-port", str(port)]) as svc:
        svc.metrics_port = port  # type: ignore[attr-defined]
        yield svc


@pytest.fixture(scope="module")
def text_tokens(tok: Tokenizer) -> list[int]:
    """A token sequence every prefix of which the grammar accepts (longer than any example)."""
    ids = tok.encode("ab" * 600)
    assert len(ids) > 200
    return ids


def live_requests(svc: ServiceProcess) -> float:
    port = svc.metrics_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "maskwire_grammar_live_requests":
                return s.value
    raise AssertionError("no maskwire_grammar_live_requests")


def wait_live(svc: ServiceProcess, want: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    got = live_requests(svc)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.02)
        got = live_requests(svc)
    assert got == want, f"service holds {got} live requests, the model {want}"


# -- the model -------------------------------------------------------------------------------


@dataclass
class Model:
    """What one stream should hold: position per request id, and which ones are dead."""

    position: dict[str, int] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)


# -- operations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Open:
    rid: str
    replay: int  # tokens of the valid text to replay


@dataclass(frozen=True)
class RowSpec:
    rid: str
    new: int  # how many new tokens
    skew: int  # added to the correct position (0: in sync)
    bad: int  # 0, BAD_RANGE or BAD_GRAMMAR: replace the last new token


@dataclass(frozen=True)
class Step:
    rows: tuple[RowSpec, ...]


@dataclass(frozen=True)
class Close:
    rid: str


@dataclass(frozen=True)
class Disconnect:
    pass


rids = st.sampled_from(IDS)
opens = st.builds(Open, rids, st.integers(0, 4))
steps = st.builds(
    Step,
    st.lists(
        st.builds(
            RowSpec,
            rids,
            st.integers(0, 3),
            st.sampled_from([0, 0, 0, 0, 0, -1, 1]),
            st.sampled_from([0, 0, 0, 0, BAD_RANGE, BAD_GRAMMAR]),
        ),
        max_size=4,
    ).map(tuple),
)
# Weighted: mostly opens and steps, so that requests live long enough to be stepped, killed,
# desynced and closed.
ops = st.one_of(opens, opens, steps, steps, steps, st.builds(Close, rids), st.just(Disconnect()))


class Runner:
    def __init__(self, svc: ServiceProcess, tok: Tokenizer, text: list[int]) -> None:
        self.svc = svc
        self.tok = tok
        self.text = text
        self.ch = channel(svc.address)
        self.client = SessionClient(self.ch)
        self.model = Model()
        self.reject = tok.encode("z")[0]

    def disconnect(self) -> None:
        self.client.end()
        self.model = Model()
        wait_live(self.svc, 0)  # closing the stream freed every request on it
        self.client = SessionClient(self.ch)

    def close_channel(self) -> None:
        self.client.end()
        self.ch.close()

    def open(self, op: Open) -> None:
        m = self.model
        opened = self.client.open(
            op.rid, self.tok, CONSTRAINT, replay_tokens=self.text[: op.replay]
        )
        assert opened.request_id == op.rid
        if op.rid in m.position:
            assert opened.HasField("error"), opened
            err = RpcError.from_status(opened.error)
            assert err.code is grpc.StatusCode.ALREADY_EXISTS and err.reason == "DUPLICATE_REQUEST"
            return
        assert not opened.HasField("error"), opened
        assert opened.position == op.replay
        m.position[op.rid] = op.replay

    def close(self, op: Close) -> None:
        m = self.model
        closed = self.client.close(op.rid)
        assert closed.request_id == op.rid
        assert closed.found is (op.rid in m.position)
        event(f"close found={closed.found} dead={op.rid in m.dead}")
        m.position.pop(op.rid, None)
        m.dead.discard(op.rid)

    def step(self, op: Step) -> None:
        m = self.model
        rows = []
        expect: list[tuple[int, str, int, int]] = []  # status, reason, position, expected_pos
        seen: set[str] = set()
        for spec in op.rows:
            pos = m.position.get(spec.rid, 0)
            new = list(self.text[pos : pos + spec.new])
            if new and spec.bad == BAD_RANGE:
                new[-1] = self.tok.vocab_size + 5
            elif new and spec.bad == BAD_GRAMMAR:
                new[-1] = self.reject
            claimed = pos + len(new) + spec.skew
            rows.append(row(spec.rid, max(claimed, 0), new))
            if spec.rid not in m.position:
                expect.append((UNKNOWN, "UNKNOWN_REQUEST", 0, 0))
                continue
            if spec.rid in seen:
                expect.append((ERROR, "DUPLICATE_ROW", -1, 0))
                continue
            seen.add(spec.rid)
            if spec.rid in m.dead:
                expect.append((ERROR, "", pos, 0))
                continue
            if max(claimed, 0) != pos + len(new):
                expect.append((DESYNC, "", pos, pos + len(new)))
                continue
            if new and spec.bad == BAD_RANGE:
                m.dead.add(spec.rid)
                expect.append((ERROR, "TOKEN_OUT_OF_RANGE", pos, 0))
                continue
            m.position[spec.rid] = pos + len(new)
            if new and spec.bad == BAD_GRAMMAR:
                m.dead.add(spec.rid)
                expect.append((ERROR, "TOKEN_REJECTED", pos + len(new), 0))
                continue
            expect.append((OK, "", pos + len(new), 0))
        res = self.client.step(rows)  # checks the echoed step number
        assert len(res.rows) == len(rows)
        mask_rows = 0
        for got, spec, (status, reason, position, expected_pos) in zip(
            res.rows, op.rows, expect, strict=True
        ):
            assert got.request_id == spec.rid
            assert got.status == status, (spec, got, self.model)
            event(f"row {grammar_pb2.RowStatus.Name(status)} {reason}".strip())
            if reason:
                assert RpcError.from_status(got.error).reason == reason, got
            if position >= 0:
                assert got.position == position, (spec, got)
            if status == DESYNC:
                assert got.expected_position == expected_pos
            if status == OK:
                assert got.mask_rows == 1 and not got.finished
            else:
                assert got.mask_rows == 0
            mask_rows += got.mask_rows
        if mask_rows:
            assert len(res.bitmask) == mask_rows * res.words_per_row * 4
        else:
            assert res.bitmask == b""

    def run(self, op: object) -> None:
        if isinstance(op, Open):
            self.open(op)
        elif isinstance(op, Close):
            self.close(op)
        elif isinstance(op, Step):
            self.step(op)
        else:
            self.disconnect()


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(ops, min_size=4, max_size=30))
# Always covered, whatever the draw: a kill by an out-of-range token, a dead request stepped and
# closed, a desync, a duplicate Open, a disconnect with live requests, a reused id after it.
@example(
    [
        Open("a", 2),
        Open("b", 0),
        Open("a", 0),
        Step((RowSpec("a", 1, 0, BAD_RANGE), RowSpec("b", 2, 0, 0), RowSpec("c", 1, 0, 0))),
        Step((RowSpec("a", 1, 0, 0), RowSpec("b", 1, 1, 0), RowSpec("b", 1, 0, 0))),
        Close("a"),
        Close("a"),
        Step((RowSpec("b", 3, 0, BAD_GRAMMAR),)),
        Open("c", 4),
        Disconnect(),
        Step((RowSpec("b", 1, 0, 0),)),
        Open("b", 1),
        Step((RowSpec("b", 2, 0, 0),)),
    ]
)
def test_session_matches_the_model(
    service: ServiceProcess, tok: Tokenizer, text_tokens: list[int], program: list[object]
) -> None:
    runner = Runner(service, tok, text_tokens)
    try:
        for op in program:
            runner.run(op)
        # Dead requests stay live until closed: the gauge counts every request of the model.
        wait_live(service, len(runner.model.position))
    finally:
        runner.close_channel()
    wait_live(service, 0)
