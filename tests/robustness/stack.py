"""One real maskwire stack (grammar service + worker + gateway) and the checks every robustness
test runs after a bad input: health, a known-good answer, and no leaked state (via metrics)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from maskwire.rpc import channel_options
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.processes import ServiceProcess, free_port, grammar_and_worker, running

MODEL = "SmolLM2-135M-Instruct"
MAX_SEQ_LEN = 256  # small context: "prompt longer than the context" is cheap to build
CHOICES = ["yes", "no"]


@dataclass
class Stack:
    grammar: ServiceProcess
    worker: ServiceProcess
    gateway: ServiceProcess
    grammar_metrics: int
    worker_metrics: int
    tokenizer: Tokenizer

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.address}"

    # -- metrics --------------------------------------------------------------------------
    def metric(self, port_or_url: int | str, name: str) -> float:
        """Sum of every sample of `name` (a gauge or counter) on a Prometheus endpoint."""
        url = (
            f"http://127.0.0.1:{port_or_url}/metrics"
            if isinstance(port_or_url, int)
            else port_or_url
        )
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name:
                    total += s.value
        return total

    def live_state(self) -> dict[str, float]:
        """What must return to its baseline once every request has ended."""
        gw = f"{self.base_url}/metrics"
        return {
            "grammar_live_requests": self.metric(
                self.grammar_metrics, "maskwire_grammar_live_requests"
            ),
            "grammar_live_sessions": self.metric(
                self.grammar_metrics, "maskwire_grammar_live_sessions"
            ),
            "worker_running": self.metric(self.worker_metrics, "maskwire_worker_running_requests"),
            "worker_queue": self.metric(self.worker_metrics, "maskwire_worker_queue_depth"),
            "gateway_in_flight": self.metric(gw, "maskwire_gateway_requests_in_flight"),
        }

    def wait_for_baseline(self, baseline: dict[str, float], timeout_s: float = 30.0) -> None:
        """Wait (bounded) until every live-state gauge is back to `baseline`."""
        deadline = time.monotonic() + timeout_s
        state = self.live_state()
        while state != baseline and time.monotonic() < deadline:
            time.sleep(0.1)
            state = self.live_state()
        assert state == baseline, f"state left behind: {state} (baseline {baseline})"

    # -- health + known-good requests -------------------------------------------------------
    def assert_healthy(self) -> None:
        for svc in (self.grammar, self.worker):
            assert svc.proc.poll() is None, f"{svc.command} died:\n{svc.log_text()[-3000:]}"
            with grpc.insecure_channel(svc.address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, svc.command
        assert self.gateway.proc.poll() is None, self.gateway.log_text()[-3000:]
        r = httpx.get(f"{self.base_url}/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text

    def good_gateway_request(self) -> None:
        """A constrained chat request through all three services answers correctly."""
        r = httpx.post(
            f"{self.base_url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                "max_tokens": 4,
                "temperature": 0,
                "structured_outputs": {"choice": CHOICES},
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] in CHOICES and choice["finish_reason"] == "stop"

    def good_worker_request(self) -> None:
        with grpc.insecure_channel(self.worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            req = worker_pb2.GenerateRequest(
                text="The capital of France is",
                sampling=worker_pb2.SamplingParams(max_tokens=2),
            )
            msgs = list(stub.Generate(req, timeout=60))
        assert "".join(m.text for m in msgs).startswith(" Paris"), msgs
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH

    def good_grammar_session(self) -> None:
        """Open, step and close on a fresh Session stream of the grammar service."""
        tok = self.tokenizer
        with grpc.insecure_channel(self.grammar.address, options=channel_options()) as ch:
            stub = grammar_pb2_grpc.GrammarServiceStub(ch)
            compiled = stub.Compile(
                grammar_pb2.CompileRequest(
                    constraint=common_pb2.Constraint(regex="(yes|no)"),
                    tokenizer=tok.fingerprint.to_proto(),
                ),
                timeout=30,
            )
            assert compiled.grammar_id
            yes = tok.encode("yes")
            msgs = [
                grammar_pb2.SessionRequest(
                    open=grammar_pb2.Open(
                        request_id="good",
                        grammar_id=compiled.grammar_id,
                        tokenizer=tok.fingerprint.to_proto(),
                    )
                ),
                grammar_pb2.SessionRequest(
                    step=grammar_pb2.Step(
                        step=1,
                        rows=[
                            grammar_pb2.StepRow(
                                request_id="good", new_tokens=yes, position=len(yes)
                            )
                        ],
                    )
                ),
                grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id="good")),
            ]
            answers = list(stub.Session(iter(msgs), timeout=30))
        assert not answers[0].opened.HasField("error"), answers[0]
        row = answers[1].step_result.rows[0]
        assert row.status == grammar_pb2.ROW_STATUS_OK and row.accepting, row
        assert answers[2].closed.found

    def assert_still_serving(self) -> None:
        self.assert_healthy()
        self.good_gateway_request()
        self.good_worker_request()
        self.good_grammar_session()


@contextlib.contextmanager
def start_stack(
    worker_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
    grammar_args: tuple[str, ...] = (),
) -> Iterator[Stack]:
    gm, wm = free_port(), free_port()
    with (
        grammar_and_worker(
            ["--metrics-port", str(wm), "--max-seq-len", str(MAX_SEQ_LEN), *worker_args],
            ["--metrics-port", str(gm), *grammar_args],
        ) as (gs, w),
        running("gateway", ["--worker", w.address, *gateway_args], http=True) as g,
    ):
        yield Stack(gs, w, g, gm, wm, load_tokenizer("default"))


def sse_events(lines: list[str]) -> list[Any]:
    """The JSON payloads of `data:` lines (without `[DONE]`)."""
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out
