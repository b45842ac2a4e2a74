"""One mutual-TLS stack for the security tests: grammar service ⇄ worker ⇄ gateway, every gRPC hop
mTLS with certificates made here, gateway API keys on, default (INFO) logging everywhere."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from maskwire.tls import ClientTLS, client_tls
from tests.support.certs import PKI, make_pki
from tests.support.processes import ServiceProcess, running

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-maskwire-security-test-key-1"
OTHER_API_KEY = "sk-maskwire-security-test-key-2"


@dataclass
class Stack:
    pki: PKI
    grammar: ServiceProcess
    worker: ServiceProcess
    gateway: ServiceProcess

    def services(self) -> list[ServiceProcess]:
        return [self.grammar, self.worker, self.gateway]

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://{self.gateway.address}/v1", api_key=key, max_retries=0, timeout=300
        )

    def tls_as(self, who: str = "gateway", server_name: str = "") -> ClientTLS:
        """Client TLS with the deployment's CA and `who`'s certificate."""
        leaf = getattr(self.pki, who)
        tls = client_tls(
            ca=str(self.pki.ca.cert),
            cert=str(leaf.cert),
            key=str(leaf.key),
            server_name=server_name,
        )
        assert tls is not None
        return tls


def _server_flags(cert: Path, key: Path, ca: Path) -> list[str]:
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(ca)]


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    ca = pki.ca.cert
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# test keys\n{API_KEY}\n{OTHER_API_KEY}\n")
    with running(
        "grammar-service",
        ["--tokenizer", "default", *_server_flags(pki.grammar.cert, pki.grammar.key, ca)],
        tls=client_tls(ca=str(ca), cert=str(pki.worker.cert), key=str(pki.worker.key)),
    ) as gs:
        worker_args = [
            *("--model", "default", "--grammar-service", gs.address),
            *("--max-batch-size", "4", "--max-seq-len", "1024"),
            *_server_flags(pki.worker.cert, pki.worker.key, ca),
            *("--grammar-tls-ca", str(ca)),
            *("--grammar-tls-cert", str(pki.worker.cert), "--grammar-tls-key", str(pki.worker.key)),
            # The grammar certificate names maskwire-grammar; the worker dials 127.0.0.1.
            *("--grammar-tls-server-name", "maskwire-grammar"),
        ]
        worker_tls = client_tls(ca=str(ca), cert=str(pki.gateway.cert), key=str(pki.gateway.key))
        with running("worker", worker_args, tls=worker_tls) as w:
            gateway_args = [
                *("--worker", w.address, "--api-key-file", str(keys)),
                *("--worker-tls-ca", str(ca), "--worker-tls-server-name", "maskwire-worker"),
                *("--worker-tls-cert", str(pki.gateway.cert)),
                *("--worker-tls-key", str(pki.gateway.key)),
            ]
            with running("gateway", gateway_args, http=True) as g:
                yield Stack(pki, gs, w, g)
