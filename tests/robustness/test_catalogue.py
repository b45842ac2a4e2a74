"""Every bad input of the catalogue gets its exact status, and afterwards all three services are
healthy, answer known-good requests correctly and hold no state left over from the bad one."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.rpc import RpcError, channel_options
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.robustness import hostile_grammars as hostile
from tests.robustness import hostile_schemas
from tests.robustness.catalogue import (
    ANY,
    ActionCase,
    GrammarCase,
    HttpCase,
    WorkerCase,
    _raw_field,
    all_cases,
    chat,
    schema_body,
)
from tests.robustness.stack import Stack
from tests.support import shared_compile


@pytest.fixture(scope="module")
def baseline(stack: Stack) -> dict[str, float]:
    state = stack.live_state()
    assert state["grammar_live_requests"] == 0 and state["worker_running"] == 0
    return state


def _params() -> list[Any]:
    out = []
    for case in all_cases():
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        api = {HttpCase: "http", WorkerCase: "worker", GrammarCase: "grammar"}.get(
            type(case), getattr(case, "api", "")
        )
        out.append(pytest.param(case, id=f"{api}-{case.name}", marks=marks))
    return out


def test_catalogue_is_big_enough() -> None:
    ids = [p.id for p in _params()]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", _params())
def test_bad_input(case: Any, stack: Stack, baseline: dict[str, float]) -> None:
    if isinstance(case, HttpCase):
        run_http(stack, case)
    elif isinstance(case, WorkerCase):
        run_worker(stack, case)
    elif isinstance(case, GrammarCase):
        run_grammar(stack, case)
    else:
        assert isinstance(case, ActionCase)
        SCENARIOS[case.scenario](stack)
    # The service is still healthy, still right, and nothing is left behind.
    stack.assert_healthy()
    stack.good_gateway_request()
    if isinstance(case, WorkerCase) or getattr(case, "api", "") == "worker":
        stack.good_worker_request()
    if isinstance(case, GrammarCase) or getattr(case, "api", "") == "grammar":
        stack.good_grammar_session()
    stack.wait_for_baseline(baseline)


# -- runners -------------------------------------------------------------------------------


def run_http(stack: Stack, case: HttpCase) -> None:
    kw: dict[str, Any] = {"headers": {"content-type": case.content_type}}
    if isinstance(case.body, bytes):
        kw["content"] = case.body
    elif case.body is not None:
        kw["content"] = json.dumps(case.body).encode()
    r = httpx.request(case.method, f"{stack.base_url}{case.path}", timeout=120, **kw)
    assert r.status_code == case.status, r.text[:1000]
    body = r.json()
    if case.status == 200:
        assert case.check is not None
        case.check(body)
        return
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if case.code is not ANY:
        assert err["code"] == case.code, err
    if case.param is not ANY:
        assert err["param"] == case.param, err
    assert case.message in err["message"], err


def _expect_rpc_error(
    call: Callable[[], Any], code: grpc.StatusCode, reason: str = "", field: str = ""
) -> RpcError:
    try:
        call()
    except grpc.RpcError as e:
        err = RpcError.from_call_error(e)
    else:
        raise AssertionError(f"expected {code.name}, the call succeeded")
    assert err.code is code, (err.code, err.message)
    if reason:
        assert err.reason == reason, (err.reason, err.message)
    if field:
        assert err.violations and err.violations[0][0] == field, err.violations
    assert err.message and "Traceback" not in err.message
    return err


def run_worker(stack: Stack, case: WorkerCase) -> None:
    with grpc.insecure_channel(stack.worker.address) as ch:
        if isinstance(case.request, bytes):
            call = ch.unary_stream(
                "/maskwire.v1.Worker/Generate",
                request_serializer=lambda b: b,
                response_deserializer=worker_pb2.GenerateResponse.FromString,
            )
        else:
            call = worker_pb2_grpc.WorkerStub(ch).Generate
        req = case.request
        _expect_rpc_error(lambda: list(call(req, timeout=60)), case.code, case.reason, case.field)


def run_grammar(stack: Stack, case: GrammarCase) -> None:
    tok = stack.tokenizer
    built = case.build(tok)
    with grpc.insecure_channel(stack.grammar.address, options=channel_options()) as ch:
        if case.kind == "compile":
            if isinstance(built, bytes):
                call = ch.unary_unary(
                    "/maskwire.v1.GrammarService/Compile",
                    request_serializer=lambda b: b,
                    response_deserializer=grammar_pb2.CompileResponse.FromString,
                )
            else:
                call = grammar_pb2_grpc.GrammarServiceStub(ch).Compile
            assert case.code is not None
            _expect_rpc_error(lambda: call(built, timeout=60), case.code, field=case.field)
            return
        setup = grammar_pb2.SessionRequest(
            open=grammar_pb2.Open(
                request_id="live",
                constraint=common_pb2.Constraint(
                    json_schema='{"type":"object","properties":{"a":{"type":"integer"}}}'
                ),
                tokenizer=tok.fingerprint.to_proto(),
            )
        )
        stub = grammar_pb2_grpc.GrammarServiceStub(ch)
        msgs = [setup, *built]
        if case.code is not None:
            _expect_rpc_error(
                lambda: list(stub.Session(iter(msgs), timeout=60)), case.code, field=case.field
            )
            return
        answers = list(stub.Session(iter(msgs), timeout=60))
    assert len(answers) == len(msgs)
    assert not answers[0].opened.HasField("error"), answers[0]
    last = answers[-1]
    if case.opened is not None:
        assert last.WhichOneof("kind") == "opened"
        assert last.opened.HasField("error"), last
        err = RpcError.from_status(last.opened.error)
        assert err.code is case.opened[0], (err.code, err.message)
        if case.opened[1]:
            assert err.reason == case.opened[1], (err.reason, err.message)
    if case.row is not None:
        assert last.WhichOneof("kind") == "step_result"
        row = last.step_result.rows[-1]  # the row the case is about
        assert row.status == case.row[0], row
        assert row.mask_rows == 0
        if case.row[1]:
            assert RpcError.from_status(row.error).reason == case.row[1], row
    if case.closed_found is not None:
        assert last.WhichOneof("kind") == "closed"
        assert last.closed.found is case.closed_found


# -- scenarios (ActionCase) ------------------------------------------------------------------

LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


def sse_disconnect(stack: Stack) -> None:
    """The client reads a few SSE events of a long stream, then closes the connection."""
    body = chat(stream=True, **LONG)
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events >= 3:
                break
    # The worker stops generating for it: its slot frees (checked by the caller's baseline).


def _raw_http(stack: Stack, body: dict[str, Any], linger_s: float) -> None:
    """Send a request on a raw socket and close it after `linger_s`, without reading."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {stack.gateway.address}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    host, port = stack.gateway.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + data)
        time.sleep(linger_s)


def sse_disconnect_early(stack: Stack) -> None:
    _raw_http(stack, chat(stream=True, **LONG), 0.0)


def http_disconnect(stack: Stack) -> None:
    _raw_http(stack, chat(**LONG), 0.5)


def external_ref(stack: Stack) -> None:
    """A `$ref` to a URL is refused and never fetched (a local server counts the hits)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/schema.json"
        schema = {"type": "object", "properties": {"a": {"$ref": url}}, "required": ["a"]}
        r = httpx.post(
            f"{stack.base_url}/v1/chat/completions", json=schema_body(schema), timeout=60
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_constraint" and "fetch" in err["message"], err
    finally:
        server.shutdown()
        server.server_close()
    assert hits == []


def grpc_cancel(stack: Stack) -> None:
    with grpc.insecure_channel(stack.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = stub.Generate(
            worker_pb2.GenerateRequest(
                text="Count:", sampling=worker_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
            ),
            timeout=60,
        )
        it = iter(call)
        next(it)
        next(it)
        call.cancel()


def duplicate_request_id(stack: Stack) -> None:
    """A second live request with the same id is refused; the first is not disturbed."""
    with grpc.insecure_channel(stack.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        params = worker_pb2.SamplingParams(max_tokens=30, ignore_eos=True)
        first = stub.Generate(
            worker_pb2.GenerateRequest(request_id="dup", text="Count:", sampling=params),
            timeout=60,
        )
        it = iter(first)
        msgs = [next(it)]  # "dup" is live now
        _expect_rpc_error(
            lambda: list(
                stub.Generate(
                    worker_pb2.GenerateRequest(request_id="dup", text="Hi", sampling=params),
                    timeout=60,
                )
            ),
            grpc.StatusCode.ALREADY_EXISTS,
            field="request_id",
        )
        msgs += list(it)
    assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in msgs) == 30


def abort_unknown(stack: Stack) -> None:
    with grpc.insecure_channel(stack.worker.address) as ch:
        resp = worker_pb2_grpc.WorkerStub(ch).Abort(
            worker_pb2.AbortRequest(request_id="never-existed"), timeout=10
        )
    assert not resp.found


def session_vanish(stack: Stack) -> None:
    """A Session stream with live requests ends without Close: the service frees them all."""
    tok = stack.tokenizer
    with grpc.insecure_channel(stack.grammar.address, options=channel_options()) as ch:
        stub = grammar_pb2_grpc.GrammarServiceStub(ch)
        opens = [
            grammar_pb2.SessionRequest(
                open=grammar_pb2.Open(
                    request_id=f"r{i}",
                    constraint=common_pb2.Constraint(regex="[a-z]{1,20}"),
                    tokenizer=tok.fingerprint.to_proto(),
                )
            )
            for i in range(3)
        ]
        gate = threading.Event()

        def requests() -> Iterator[grammar_pb2.SessionRequest]:
            yield from opens
            gate.wait(30)  # keep the stream open until the test has seen the requests live

        call = stub.Session(requests(), timeout=60)
        for _ in opens:
            assert not next(call).opened.HasField("error")
        assert stack.metric(stack.grammar_metrics, "maskwire_grammar_live_requests") >= 3
        call.cancel()
        gate.set()


def compile_starvation(stack: Stack) -> None:
    """One connection's hanging compiles never take every compile worker: a compile from
    another connection is answered at once, the hanging ones end at the compile deadline."""
    tok = stack.tokenizer
    results: list[Any] = []
    # Compile workers killed by earlier cases are back (each takes a few seconds to start).
    deadline = time.monotonic() + 60
    while stack.metric(stack.grammar_metrics, "maskwire_grammar_sandbox_workers") < 2:
        assert time.monotonic() < deadline, "the compile workers did not come back"
        time.sleep(0.2)

    # Channels of one process share a connection unless told not to: one connection per client.
    own = [("grpc.use_local_subchannel_pool", 1)]

    def hang(i: int) -> None:
        with grpc.insecure_channel(stack.grammar.address, options=own) as ch:
            stub = grammar_pb2_grpc.GrammarServiceStub(ch)
            calls = [
                stub.Compile.future(
                    grammar_pb2.CompileRequest(
                        constraint=hostile.hang_constraint(j), tokenizer=tok.fingerprint.to_proto()
                    ),
                    timeout=30,
                )
                for j in (2 * i, 2 * i + 1)
            ]
            for c in calls:
                try:
                    c.result()
                    results.append("answered")
                except grpc.RpcError as e:
                    results.append(e.code())

    hog = threading.Thread(target=hang, args=(0,))
    hog.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    with grpc.insecure_channel(stack.grammar.address, options=own) as ch:
        grammar_pb2_grpc.GrammarServiceStub(ch).Compile(
            grammar_pb2.CompileRequest(
                constraint=common_pb2.Constraint(regex="starve[0-9]{3}"),
                tokenizer=tok.fingerprint.to_proto(),
            ),
            timeout=30,
        )
    assert time.monotonic() - t0 < 2.0, "a small compile waited behind the hanging ones"
    hog.join()
    assert results == [hostile.EXPECT_HANG, hostile.EXPECT_HANG], results


SCENARIOS: dict[str, Callable[[Stack], None]] = {
    f.__name__: f
    for f in (
        compile_starvation,
        sse_disconnect,
        sse_disconnect_early,
        http_disconnect,
        external_ref,
        grpc_cancel,
        duplicate_request_id,
        abort_unknown,
        session_vanish,
    )
}


# -- hostile-input scenarios, gateway and worker side ------------------------------------------


def bounded_echoes(stack: Stack) -> None:
    """Errors that quote megabytes of input stay small (and keep their status)."""
    url = f"{stack.base_url}/v1/chat/completions"
    for body, status in (
        (chat(model="m" * 1_000_000), 404),
        (chat(logit_bias={"k" * 1_000_000: "not a number"}), 422),  # pydantic's loc holds the key
        (chat(response_format={"type": "t" * 1_000_000}), 422),  # its message quotes the tag
    ):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status, r.text[:500]
        assert len(r.content) < 10_000, len(r.content)


# Health must answer within a second; measured 0.002-0.03 s during these scenarios on
# an idle machine, 2-10 s before the fix. The bound leaves room for a loaded shared CI machine,
# where the polling thread itself can wait for a CPU; the unit test
# tests/unit/worker/test_servicer_limits.py bounds the worker's event-loop lag strictly.
HEALTH_BOUND_S = 2.0


class _HealthWatch:
    """Polls the worker's gRPC health and the gateway's /health in a thread, recording the
    slowest answer and any answer that was not SERVING / "ok"."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.slowest = 0.0
        self.slowest_worker = self.slowest_gateway = 0.0
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.stack.worker.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                resp = health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    self.bad.append("worker not serving")
                t1 = time.perf_counter()
                status = httpx.get(f"{self.stack.base_url}/health", timeout=30).json()["status"]
                if status != "ok":
                    self.bad.append(f"gateway {status}")
                t2 = time.perf_counter()
                self.slowest_worker = max(self.slowest_worker, t1 - t0)
                self.slowest_gateway = max(self.slowest_gateway, t2 - t1)
                self.slowest = max(self.slowest_worker, self.slowest_gateway)
                time.sleep(0.05)

    def __repr__(self) -> str:
        return (
            f"health: not ok {self.bad}, slowest worker {self.slowest_worker:.2f}s, "
            f"gateway {self.slowest_gateway:.2f}s"
        )

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def big_prompt_through_gateway(stack: Stack) -> None:
    """A 5 MB prompt is refused by the gateway itself; health stays "ok" and quick throughout."""
    body = chat(messages=[{"role": "user", "content": "hello world " * 420_000}])
    with _HealthWatch(stack) as watch:
        time.sleep(0.2)
        r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
        time.sleep(0.2)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_large", r.text[:500]
    assert not watch.bad and watch.slowest < HEALTH_BOUND_S, watch


def big_prompts_at_worker(stack: Stack) -> None:
    """Four 3 MB prompts (over --max-prompt-bytes) and two of 0.9 MB (tokenized, then too many
    tokens) at once: health keeps answering, memory stays bounded."""
    rss_before = _rss_mb(stack.worker.proc.pid)
    peak = rss_before
    texts = ["hello world " * 250_000] * 4 + ["hello world " * 75_000] * 2
    errors: list[RpcError] = []

    def send(text: str) -> None:
        with grpc.insecure_channel(stack.worker.address, options=channel_options()) as ch:
            req = worker_pb2.GenerateRequest(text=text, sampling=worker_pb2.SamplingParams())
            errors.append(
                _expect_rpc_error(
                    lambda: list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60)),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    field="prompt",
                )
            )

    with _HealthWatch(stack) as watch:
        senders = [threading.Thread(target=send, args=(t,)) for t in texts]
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            peak = max(peak, _rss_mb(stack.worker.proc.pid))
            time.sleep(0.02)
    assert len(errors) == len(texts)
    assert sum("bytes of text" in e.violations[0][1] for e in errors) == 4
    assert not watch.bad and watch.slowest < HEALTH_BOUND_S, watch
    assert peak - rss_before < 1024, f"worker RSS grew {peak - rss_before:.0f} MB"


def _raw_stream(address: str, method: str, payloads: list[bytes]) -> RpcError:
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(method, request_serializer=lambda b: b)
        return _expect_rpc_error(
            lambda: list(call(iter(payloads), timeout=30)),
            grpc.StatusCode.INVALID_ARGUMENT,
            reason="UNDECODABLE_REQUEST",
        )


SESSION = "/maskwire.v1.GrammarService/Session"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def _live_open(stack: Stack) -> bytes:
    """An Open that succeeds, so the stream has a live request when the bad message comes."""
    return grammar_pb2.SessionRequest(
        open=grammar_pb2.Open(
            request_id="live",
            constraint=common_pb2.Constraint(regex="[a-z]+"),
            tokenizer=stack.tokenizer.fingerprint.to_proto(),
        )
    ).SerializeToString()


def session_garbage(stack: Stack) -> None:
    _raw_stream(stack.grammar.address, SESSION, [_live_open(stack), b"\xff\xff\xff"])


def session_invalid_utf8(stack: Stack) -> None:
    close = _raw_field(3, _raw_field(1, b"live\xff\xfe"))  # Close{request_id: invalid UTF-8}
    _raw_stream(stack.grammar.address, SESSION, [_live_open(stack), close])


def grammar_reflection_garbage(stack: Stack) -> None:
    _raw_stream(stack.grammar.address, REFLECTION, [b"\xff\xff\xff"])


def worker_reflection_garbage(stack: Stack) -> None:
    _raw_stream(stack.worker.address, REFLECTION, [b"\xff\xff\xff"])


SCENARIOS.update(
    {
        f.__name__: f
        for f in (
            bounded_echoes,
            big_prompt_through_gateway,
            big_prompts_at_worker,
            session_garbage,
            session_invalid_utf8,
            grammar_reflection_garbage,
            worker_reflection_garbage,
        )
    }
)


# -- request ids: Abort and cancellation stop exactly the caller's own call --------------------

# One connection per client: channels of one process share a connection unless told not to.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _count(max_tokens: int) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _start(
    stub: worker_pb2_grpc.WorkerStub, request_id: str, n: int, max_tokens: int
) -> tuple[Iterator[worker_pb2.GenerateResponse], list[worker_pb2.GenerateResponse]]:
    """Start a call and read its first message (it is live from then on)."""
    req = worker_pb2.GenerateRequest(
        request_id=request_id, n=n, text="Count:", sampling=_count(max_tokens)
    )
    it = iter(stub.Generate(req, timeout=120))
    return it, [next(it)]


def _ran_to_length(msgs: list[worker_pb2.GenerateResponse], n: int, max_tokens: int) -> None:
    finals = [m for m in msgs if m.finish_reason]
    assert sorted(m.index for m in finals) == list(range(n)), finals
    assert {m.finish_reason for m in finals} == {worker_pb2.FINISH_REASON_LENGTH}, finals
    assert sum(len(m.token_ids) for m in msgs) == n * max_tokens


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.05)


def abort_empty_id(stack: Stack) -> None:
    """Abort with an empty id, or one no call can have, is INVALID_ARGUMENT and stops nothing:
    a named request and one whose id the worker assigned both run to their end."""
    with grpc.insecure_channel(stack.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        live = [_start(stub, rid, 1, 30) for rid in ("busy", "")]
        for rid in ("", "busy/0"):
            _expect_rpc_error(
                lambda rid=rid: stub.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT,
                field="request_id",
            )
        for it, msgs in live:
            msgs += list(it)
            _ran_to_length(msgs, 1, 30)


def colliding_request_ids(stack: Stack) -> None:
    """A call whose id is live is refused (ALREADY_EXISTS) whatever the n of either, and the
    live calls are not disturbed."""
    with grpc.insecure_channel(stack.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        live = {rid: (_start(stub, rid, n, 30), n) for rid, n in (("pair", 2), ("solo", 1))}
        for rid, n in (("pair", 1), ("pair", 2), ("pair", 3), ("solo", 2), ("solo", 1)):
            req = worker_pb2.GenerateRequest(request_id=rid, n=n, text="Hi", sampling=_count(2))
            _expect_rpc_error(
                lambda req=req: list(stub.Generate(req, timeout=60)),
                grpc.StatusCode.ALREADY_EXISTS,
                field="request_id",
            )
        for (it, msgs), n in live.values():
            msgs += list(it)
            _ran_to_length(msgs, n, 30)


def cancel_ends_its_own_call(stack: Stack) -> None:
    """Client A's n = 2 call and client B's call run together (B's try to reuse A's id was
    refused); A cancels: both of A's slots are free at once while B's request runs to its end."""

    def running() -> float:
        return stack.metric(stack.worker_metrics, "maskwire_worker_running_requests")

    address = stack.worker.address
    with (
        grpc.insecure_channel(address, options=OWN_CONNECTION) as ch_a,
        grpc.insecure_channel(address, options=OWN_CONNECTION) as ch_b,
    ):
        a, b = worker_pb2_grpc.WorkerStub(ch_a), worker_pb2_grpc.WorkerStub(ch_b)
        call_a = a.Generate(
            worker_pb2.GenerateRequest(
                request_id="shared", n=2, text="Count:", sampling=_count(120)
            ),
            timeout=120,
        )
        next(iter(call_a))
        _expect_rpc_error(
            lambda: list(
                b.Generate(
                    worker_pb2.GenerateRequest(request_id="shared", text="Hi", sampling=_count(2)),
                    timeout=60,
                )
            ),
            grpc.StatusCode.ALREADY_EXISTS,
            field="request_id",
        )
        it_b, msgs_b = _start(b, "other", 1, 120)
        _until(lambda: running() == 3, "A's two choices and B's request running")
        call_a.cancel()
        _until(lambda: running() == 1, "A's slots freed")
        msgs_b += list(it_b)
    _ran_to_length(msgs_b, 1, 120)


SCENARIOS.update(
    {f.__name__: f for f in (abort_empty_id, colliding_request_ids, cancel_ends_its_own_call)}
)


# -- compile scenarios: shared compiles --------------------------------------------------------


def shared_compile_cancel(stack: Stack) -> None:
    """Two clients compile one slow constraint; the first cancels; the second gets its compile,
    its Open, and an unrelated request on its stream answered."""
    slow = shared_compile.choices(seed=7, n=100_000)
    shared_compile.cancel_one_caller_of_a_shared_compile(
        stack.grammar.address, stack.tokenizer, slow
    )


SCENARIOS[shared_compile_cancel.__name__] = shared_compile_cancel

SCENARIOS.update(hostile_schemas.SCENARIOS)
