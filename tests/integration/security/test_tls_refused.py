"""TLS refused from the client side: a real worker whose grammar-service TLS settings do not fit a
replica (its CA did not sign the replica's certificate, or the certificate lacks the server name
the worker expects) and a real gateway whose worker CA is wrong fail with an error that names
each TLS failure, and never fall back to plaintext.

One worker meets all three cases, as three replicas of its grammar service:

* the deployment's grammar service: certificate signed by the CA the worker trusts, but not for
  the server name the worker expects (`--grammar-tls-server-name`);
* a grammar service whose certificate carries that name but is signed by a CA the worker does not
  trust;
* a plaintext grammar service: a client that retried without TLS would reach it and succeed (and
  it would count a session).
"""

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
from maskwire.tls import client_tls
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.processes import ServiceProcess, free_port, running

from .conftest import MODEL, Stack

EXPECTED_NAME = "grammar.maskwire.test"  # the name the worker checks; only the stranger has it
# How gRPC reports each refusal (any one of the spellings of the versions we run).
UNTRUSTED = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed")
WRONG_NAME = ("Hostname Verification Check failed", "not in peer certificate")
NOT_TLS = ("WRONG_VERSION_NUMBER", "handshake failed")  # a TLS client facing a plaintext server


@dataclass
class Clients:
    untrusted_grammar: ServiceProcess  # TLS, EXPECTED_NAME, certificate from an untrusted CA
    plain_grammar: ServiceProcess  # plaintext: what a fallback would reach
    worker: ServiceProcess  # plaintext itself; TLS (misfitting) towards its grammar replicas


def failures(message: str, label: str = "grammar replica ") -> dict[str, str]:
    """`{label}ADDR: detail` parts of an error message, by address."""
    pattern = rf"{label}(127\.0\.0\.1:\d+): (.*?)(?=; {label}127\.0\.0\.1:\d+: |\)?$)"
    return dict(re.findall(pattern, message))


def says(text: str, spellings: tuple[str, ...]) -> bool:
    return any(s in text for s in spellings)


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
    stranger = pki.other_ca.issue("untrusted-grammar", dns=(EXPECTED_NAME,), ips=())
    metrics_port = free_port()
    with ExitStack() as es:
        untrusted = es.enter_context(
            running(
                "grammar-service",
                [
                    *("--tokenizer", "default"),
                    *("--tls-cert", str(stranger.cert), "--tls-key", str(stranger.key)),
                ],
                tls=client_tls(ca=str(pki.other_ca.cert), server_name=EXPECTED_NAME),
            )
        )
        plain = es.enter_context(
            running(
                "grammar-service", ["--tokenizer", "default", "--metrics-port", str(metrics_port)]
            )
        )
        plain.metrics_port = metrics_port  # type: ignore[attr-defined]
        replicas = [stack.grammar.address, untrusted.address, plain.address]
        worker = es.enter_context(
            running(
                "worker",
                [
                    *("--model", "default", "--max-batch-size", "1", "--max-seq-len", "256"),
                    *("--grammar-service", ",".join(replicas)),
                    *("--grammar-tls-ca", str(pki.ca.cert)),
                    *("--grammar-tls-server-name", EXPECTED_NAME),
                    *("--grammar-tls-cert", str(pki.worker.cert)),
                    *("--grammar-tls-key", str(pki.worker.key)),
                ],
            )
        )
        yield Clients(untrusted, plain, worker)


def test_worker_with_misfitting_grammar_tls_fails_clearly_without_plaintext(
    stack: Stack, clients: Clients
) -> None:
    plain_port: int = clients.plain_grammar.metrics_port  # type: ignore[attr-defined]
    sessions = _metric(plain_port, "maskwire_grammar_live_sessions")
    req = worker_pb2.GenerateRequest(
        text="The answer is",
        sampling=worker_pb2.SamplingParams(temperature=0, max_tokens=4),
        constraint=common_pb2.Constraint(regex="(yes|no)"),
    )
    with grpc.insecure_channel(clients.worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=60))
        err = RpcError.from_call_error(info.value)  # type: ignore[arg-type]
        assert err.code is grpc.StatusCode.UNAVAILABLE, err.message
        assert err.reason == "GRAMMAR_SERVICE_UNAVAILABLE"
        # Every replica's refusal is in the error, each for its own reason.
        why = failures(err.message)
        assert set(why) == {
            stack.grammar.address,
            clients.untrusted_grammar.address,
            clients.plain_grammar.address,
        }, err.message
        assert says(why[stack.grammar.address], WRONG_NAME), why
        assert says(why[clients.untrusted_grammar.address], UNTRUSTED), why
        assert says(why[clients.plain_grammar.address], NOT_TLS), why
        # No fallback: the plaintext replica never got a session.
        assert _metric(plain_port, "maskwire_grammar_live_sessions") == sessions
        # The worker still serves unconstrained requests.
        plain_req = worker_pb2.GenerateRequest(
            text="The capital of France is", sampling=worker_pb2.SamplingParams(max_tokens=2)
        )
        msgs = list(stub.Generate(plain_req, timeout=60))
    assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    log = clients.worker.log_text()
    assert says(log, WRONG_NAME) and says(log, UNTRUSTED)


def test_gateway_with_wrong_worker_ca_fails_clearly_without_plaintext(
    stack: Stack, clients: Clients
) -> None:
    pki = stack.pki
    gateway_args = [
        # The mTLS worker (whose CA the gateway does not trust) and a plaintext worker.
        *("--worker", f"{stack.worker.address},{clients.worker.address}"),
        *("--worker-tls-ca", str(pki.other_ca.cert), "--worker-tls-server-name", "maskwire-worker"),
        *("--worker-tls-cert", str(pki.gateway.cert), "--worker-tls-key", str(pki.gateway.key)),
    ]
    with running("gateway", gateway_args, http=True) as g:
        health = httpx.get(f"http://{g.address}/health", timeout=10).json()
        assert health["status"] == "degraded"
        assert {w["address"]: w["healthy"] for w in health["workers"]} == {
            stack.worker.address: False,
            clients.worker.address: False,
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
        # "no worker is available (ADDR: detail; ADDR: detail)": each worker's refusal.
        message = r.json()["error"]["message"]
        why = failures(message, label="")
        assert set(why) == {stack.worker.address, clients.worker.address}, message
        assert says(why[stack.worker.address], UNTRUSTED), why
        assert says(why[clients.worker.address], NOT_TLS), why  # plaintext: refused, not used
