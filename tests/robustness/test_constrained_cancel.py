"""A *constrained* request that ends early (the HTTP client disconnects, the gRPC client cancels,
`Abort`) frees its grammar matcher on the grammar service and its KV slot on the worker.

Checked on the real stack's metrics: the grammar service's live-request gauge, the worker's
running-request gauge (one KV slot each) and queue, the gateway's in-flight gauge all return to
their baseline, and the worker counts the request as aborted (it did not run to its end).
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.robustness.catalogue import chat
from tests.robustness.stack import Stack

# No EOS before 400 letters and at most 200 tokens: every request here would run for seconds;
# each test ends it after its first tokens.
LONG_REGEX = "[a-z]{400}"
MAX_TOKENS = 200


@pytest.fixture
def baseline(stack: Stack) -> Iterator[dict[str, float]]:
    state = stack.live_state()
    assert state["grammar_live_requests"] == 0 and state["worker_running"] == 0, state
    yield state
    stack.assert_healthy()


def aborted_constrained(stack: Stack) -> float:
    """The worker's count of constrained requests that finished as aborted."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.worker_metrics}/metrics") as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if (
                s.name == "maskwire_worker_requests_total"
                and s.labels.get("finish_reason") == "abort"
                and s.labels.get("constrained") == "true"
            ):
                return s.value
    return 0.0


def wait_live(stack: Stack, grammar: float, worker: float, timeout_s: float = 30.0) -> None:
    """Wait until the grammar service holds `grammar` requests and the worker runs `worker`."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = stack.live_state()
        got = (state["grammar_live_requests"], state["worker_running"])
        if got == (grammar, worker):
            return
        assert time.monotonic() < deadline, (
            f"live (grammar, worker) {got}, want {(grammar, worker)}"
        )
        time.sleep(0.05)


def constrained_request(request_id: str = "") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        text="Letters:",
        sampling=worker_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        constraint=common_pb2.Constraint(regex=LONG_REGEX),
    )


def assert_every_slot_free(stack: Stack, baseline: dict[str, float]) -> None:
    """`max_batch_size` requests at once all get a KV slot (none waits in the queue): a slot
    kept by an ended request would leave one of them waiting."""
    with grpc.insecure_channel(stack.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        slots = stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10).max_batch_size
        params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        calls = [
            stub.Generate(worker_pb2.GenerateRequest(text=f"{i}:", sampling=params), timeout=60)
            for i in range(slots)
        ]
        try:
            deadline = time.monotonic() + 30
            while True:
                state = stack.live_state()
                if state["worker_running"] == slots and state["worker_queue"] == 0:
                    break
                assert time.monotonic() < deadline, f"{slots} requests did not all run: {state}"
                time.sleep(0.05)
        finally:
            for c in calls:
                c.cancel()
    stack.wait_for_baseline(baseline)


def assert_freed(stack: Stack, baseline: dict[str, float], aborted_before: float) -> None:
    stack.wait_for_baseline(baseline)
    assert aborted_constrained(stack) == aborted_before + 1
    assert_every_slot_free(stack, baseline)


def test_gateway_client_disconnect_frees_the_matcher_and_the_slot(
    stack: Stack, baseline: dict[str, float]
) -> None:
    before = aborted_constrained(stack)
    body: dict[str, Any] = chat(
        stream=True, max_tokens=MAX_TOKENS, structured_outputs={"regex": LONG_REGEX}
    )
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 4:
                break
        wait_live(stack, 1, 1)  # mid-generation: one matcher, one slot
    assert_freed(stack, baseline, before)


def test_grpc_cancel_frees_the_matcher_and_the_slot(
    stack: Stack, baseline: dict[str, float]
) -> None:
    before = aborted_constrained(stack)
    with grpc.insecure_channel(stack.worker.address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).Generate(constrained_request(), timeout=60)
        it = iter(call)
        first = [next(it), next(it)]
        assert all(m.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED for m in first)
        wait_live(stack, 1, 1)
        call.cancel()
    assert_freed(stack, baseline, before)


def test_abort_frees_the_matcher_and_the_slot(stack: Stack, baseline: dict[str, float]) -> None:
    before = aborted_constrained(stack)
    with grpc.insecure_channel(stack.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = stub.Generate(constrained_request("abort-constrained"), timeout=60)
        it = iter(call)
        msgs = [next(it), next(it)]
        wait_live(stack, 1, 1)
        found = stub.Abort(worker_pb2.AbortRequest(request_id="abort-constrained"), timeout=10)
        assert found.found
        msgs += list(it)
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_ABORT, msgs[-1]
        text = "".join(m.text for m in msgs)
        assert text.isalpha() and text.islower() and len(text) < 400, text
        again = stub.Abort(worker_pb2.AbortRequest(request_id="abort-constrained"), timeout=10)
        assert not again.found
    assert_freed(stack, baseline, before)


def test_cancel_while_the_grammar_open_is_unanswered_frees_the_matcher(
    stack: Stack, baseline: dict[str, float]
) -> None:
    """The client cancels while the worker waits for `Opened` (the grammar service is stopped):
    when the service comes back it applies the Open, and the worker must close it."""
    lookups = stack.metric(stack.grammar_metrics, "maskwire_grammar_cache_lookups_total")
    stack.grammar.kill(signal.SIGSTOP)
    try:
        with grpc.insecure_channel(stack.worker.address) as ch:
            call = worker_pb2_grpc.WorkerStub(ch).Generate(
                constrained_request("open-pending"), timeout=60
            )
            time.sleep(1.0)  # the worker has sent the Open; nothing can answer it
            call.cancel()
            time.sleep(0.5)  # the worker has seen the cancellation
    finally:
        stack.grammar.kill(signal.SIGCONT)
    # The service has applied the Open (it looked the constraint up) before the state is read:
    # a leaked matcher shows from then on.
    deadline = time.monotonic() + 30
    while stack.metric(stack.grammar_metrics, "maskwire_grammar_cache_lookups_total") == lookups:
        assert time.monotonic() < deadline, "the grammar service never received the Open"
        time.sleep(0.05)
    stack.wait_for_baseline(baseline)
    assert_every_slot_free(stack, baseline)
    # The request id is free again on the worker: the same id runs to its first tokens.
    with grpc.insecure_channel(stack.worker.address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).Generate(
            constrained_request("open-pending"), timeout=60
        )
        assert next(iter(call)).token_ids
        call.cancel()
    stack.wait_for_baseline(baseline)
