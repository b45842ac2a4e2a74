"""Mutual TLS on every gRPC hop and gateway API keys, against the real stack (see conftest)."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.tls import ClientTLS, client_tls, make_sync_channel
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import MODEL, Stack

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_constrained_chat_through_gateway_worker_and_grammar_over_mtls(stack: Stack) -> None:
    r = stack.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
        },
        temperature=0,
        max_tokens=40,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)


def test_grpc_client_with_a_certificate_reaches_the_worker(stack: Stack) -> None:
    with make_sync_channel(stack.worker.address, stack.tls_as("gateway", "maskwire-worker")) as ch:
        req = worker_pb2.GenerateRequest(
            request_id="mtls-regex",
            text="The answer is",
            sampling=worker_pb2.SamplingParams(temperature=0, max_tokens=8),
            constraint=common_pb2.Constraint(regex="(yes|no)"),
        )
        text = "".join(m.text for m in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=120))
    assert text in ("yes", "no")


def _health(address: str, tls: ClientTLS | None) -> grpc.StatusCode:
    with make_sync_channel(address, tls) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("server", ["grammar", "worker"])
def test_clients_without_a_valid_certificate_are_refused(stack: Stack, server: str) -> None:
    svc = stack.grammar if server == "grammar" else stack.worker
    pki = stack.pki
    ca = str(pki.ca.cert)
    assert _health(svc.address, stack.tls_as("gateway")) == grpc.StatusCode.OK
    refused = {
        "no client certificate": client_tls(ca=ca),
        "certificate from an untrusted CA": client_tls(
            ca=ca, cert=str(pki.stranger.cert), key=str(pki.stranger.key)
        ),
        "client trusting a different CA": client_tls(
            ca=str(pki.other_ca.cert), cert=str(pki.gateway.cert), key=str(pki.gateway.key)
        ),
        "plaintext": None,
    }
    for what, tls in refused.items():
        assert _health(svc.address, tls) == grpc.StatusCode.UNAVAILABLE, what


def test_gateway_requires_the_api_key(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        stack.client("sk-not-a-key").models.list()
    assert e.value.status_code == 401
    assert e.value.response.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in stack.client().models.list()] == [MODEL]
