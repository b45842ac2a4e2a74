"""TLS refused from the client side: a real worker whose grammar-service TLS settings are wrong
(an untrusted CA, a server name the certificate does not carry) and a real gateway whose worker
CA is wrong fail with an error that names the TLS failure, and never fall back to plaintext.

No fallback is checked against a plaintext server in the same list: a client that retried
without TLS would reach it and succeed (and the plaintext grammar service would count a
session)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.processes import ServiceProcess, free_port, running

from .conftest import MODEL, Stack

# How gRPC reports each refusal (any one of the spellings of the versions we run).
UNTRUSTED = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed")
WRONG_NAME = ("Hostname Verification Check failed", "not in peer certificate")
NOT_TLS = ("WRONG_VERSION_NUMBER", "handshake failed")  # a TLS client facing a plaintext server


def failures(message: str) -> dict[str, str]:
    """`grammar replica ADDR: detail` parts of an error message, by address."""
    return dict(re.findall(r"grammar replica (\S+?): (.*?)(?=; grammar replica |$)", message))


def says(text: str, spellings: tuple[str, ...]) -> bool:
    return any(s in text for s in spellings)


@dataclass
class Clients:
    plain_grammar: ServiceProcess  # a plaintext grammar service: what a fallback would reach
    wrong_ca: ServiceProcess  # worker trusting another CA for the grammar service
    wrong_name: ServiceProcess  # worker expecting another server name


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for fam in text_string_to_metric_families(r.read().decode()):
            for s in fam.samples:
                if s.name == name:
                    return s.value
    raise AssertionError(f"no {name}")


@pytest.fixture(scope="module")
def clients(stack: Stack) -> Iterator[Clients]:
    pki = stack.pki
    metrics_port = free_port()
    with ExitStack() as es:
        plain = es.enter_context(
            running(
                "grammar-service",
                ["--tokenizer", "default", "--metrics-port", str(metrics_port)],
            )
        )
        plain.metrics_port = metrics_port  # type: ignore[attr-defined]
        base = [
            *("--model", "default", "--max-batch-size", "1", "--max-seq-len", "256"),
            *("--grammar-service", f"{stack.grammar.address},{plain.address}"),
            *("--grammar-tls-cert", str(pki.worker.cert), "--grammar-tls-key", str(pki.worker.key)),
        ]
        # Both workers load the model at the same time; wait for them together.
        wrong_ca = ServiceProcess(
            "worker",
            [
                *base,
                *("--grammar-tls-ca", str(pki.other_ca.cert)),
                *("--grammar-tls-server-name", "maskwire-grammar"),
            ],
            free_port(),
        )
        es.callback(wrong_ca.stop)
        wrong_name = ServiceProcess(
            "worker",
            [
                *base,
                *("--grammar-tls-ca", str(pki.ca.cert)),
                *("--grammar-tls-server-name", "not-the-grammar-service"),
            ],
            free_port(),
        )
        es.callback(wrong_name.stop)
        wrong_ca.wait_ready()
        wrong_name.wait_ready()
        yield Clients(plain, wrong_ca, wrong_name)


def _constrained_generate(worker: ServiceProcess) -> RpcError:
    req = worker_pb2.GenerateRequest(
        text="The answer is",
        sampling=worker_pb2.SamplingParams(temperature=0, max_tokens=4),
        constraint=common_pb2.Constraint(regex="(yes|no)"),
    )
    with grpc.insecure_channel(worker.address) as ch:
        try:
            list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60))
        except grpc.RpcError as e:
            return RpcError.from_call_error(e)  # type: ignore[arg-type]
    raise AssertionError("the constrained request succeeded: some replica was reached")


@pytest.mark.parametrize("which", ["wrong_ca", "wrong_name"])
def test_worker_with_wrong_grammar_tls_fails_clearly_without_plaintext(
    stack: Stack, clients: Clients, which: str
) -> None:
    worker: ServiceProcess = getattr(clients, which)
    sessions = _metric(clients.plain_grammar.metrics_port, "maskwire_grammar_live_sessions")  # type: ignore[attr-defined]
    err = _constrained_generate(worker)
    assert err.code is grpc.StatusCode.UNAVAILABLE, err.message
    assert err.reason == "GRAMMAR_SERVICE_UNAVAILABLE"
    # Each replica's refusal is in the error: the TLS one for the reason of the test, the
    # plaintext one because the worker insisted on TLS.
    why = failures(err.message)
    assert set(why) == {stack.grammar.address, clients.plain_grammar.address}, err.message
    assert says(why[stack.grammar.address], UNTRUSTED if which == "wrong_ca" else WRONG_NAME), why
    assert says(why[clients.plain_grammar.address], NOT_TLS), why
    # The plaintext replica never got a session (no fallback), and the worker still serves
    # unconstrained requests.
    assert (
        _metric(clients.plain_grammar.metrics_port, "maskwire_grammar_live_sessions")  # type: ignore[attr-defined]
        == sessions
    )
    req = worker_pb2.GenerateRequest(
        text="The capital of France is", sampling=worker_pb2.SamplingParams(max_tokens=2)
    )
    with grpc.insecure_channel(worker.address) as ch:
        msgs = list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60))
    assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert says(worker.log_text(), UNTRUSTED if which == "wrong_ca" else WRONG_NAME)


def test_gateway_with_wrong_worker_ca_fails_clearly_without_plaintext(
    stack: Stack, clients: Clients
) -> None:
    pki = stack.pki
    gateway_args = [
        # The mTLS worker (whose CA the gateway does not trust) and a plaintext worker.
        *("--worker", f"{stack.worker.address},{clients.wrong_ca.address}"),
        *("--worker-tls-ca", str(pki.other_ca.cert), "--worker-tls-server-name", "maskwire-worker"),
        *("--worker-tls-cert", str(pki.gateway.cert), "--worker-tls-key", str(pki.gateway.key)),
    ]
    with running("gateway", gateway_args, http=True) as g:
        health = httpx.get(f"http://{g.address}/health", timeout=10).json()
        assert health["status"] == "degraded"
        assert {w["address"]: w["healthy"] for w in health["workers"]} == {
            stack.worker.address: False,
            clients.wrong_ca.address: False,
        }
        assert httpx.get(f"http://{g.address}/ready", timeout=10).status_code == 503
        r = httpx.post(
            f"http://{g.address}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            timeout=60,
        )
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        # "no worker is available (ADDR: detail; ADDR: detail)": each worker's refusal.
        why = dict(re.findall(r"(127\.0\.0\.1:\d+): (.*?)(?=; 127\.0\.0\.1:\d+: |\)$)", message))
        assert set(why) == {stack.worker.address, clients.wrong_ca.address}, message
        assert says(why[stack.worker.address], UNTRUSTED), why
        assert says(why[clients.wrong_ca.address], NOT_TLS), why  # plaintext: refused, not used
