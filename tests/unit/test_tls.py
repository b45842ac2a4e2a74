"""maskwire.tls: flag validation, and real TLS / mTLS handshakes against an in-process server."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.rpc import Server
from maskwire.tls import (
    ClientTLS,
    TLSConfigError,
    add_client_tls_arguments,
    add_server_tls_arguments,
    client_tls,
    client_tls_from_args,
    make_channel,
    server_credentials,
    server_credentials_from_args,
)
from tests.support.certs import PKI, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ------------------------------------------------------------------------------ flag validation
def test_no_flags_means_plaintext() -> None:
    assert server_credentials(None, None) is None
    assert client_tls() is None


def test_server_flags_parse(pki: PKI) -> None:
    p = argparse.ArgumentParser()
    add_server_tls_arguments(p)
    args = p.parse_args(
        [
            *("--tls-cert", str(pki.grammar.cert), "--tls-key", str(pki.grammar.key)),
            *("--tls-client-ca", str(pki.ca.cert), "--health-port", "9"),
        ]
    )
    assert isinstance(server_credentials_from_args(args), grpc.ServerCredentials)
    assert args.health_port == 9
    assert server_credentials_from_args(p.parse_args([])) is None


def test_client_flags_parse(pki: PKI) -> None:
    p = argparse.ArgumentParser()
    add_client_tls_arguments(p, "grammar", "the grammar service")
    args = p.parse_args(
        ["--grammar-tls-ca", str(pki.ca.cert), "--grammar-tls-server-name", "maskwire-grammar"]
    )
    tls = client_tls_from_args(args, "grammar")
    assert isinstance(tls, ClientTLS)
    assert tls.channel_options() == [("grpc.ssl_target_name_override", "maskwire-grammar")]
    assert client_tls_from_args(p.parse_args([]), "grammar") is None
    # --grammar-tls alone: TLS trusting the system roots.
    assert client_tls_from_args(p.parse_args(["--grammar-tls"]), "grammar") is not None


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_cert", "--tls-cert: no such file"),
        ("half_pair", "--tls-cert and --tls-key go together"),
        ("ca_without_cert", "--tls-client-ca needs --tls-cert and --tls-key"),
        ("wrong_key", "is not the private key of --tls-cert"),
        ("garbage_cert", "not a PEM certificate and private key"),
        ("garbage_ca", "--tls-client-ca"),
    ],
)
def test_server_errors_are_clear(pki: PKI, tmp_path: Path, case: str, message: str) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cert, key = str(pki.grammar.cert), str(pki.grammar.key)
    kwargs = {
        "missing_cert": (str(tmp_path / "nope.crt"), key, None),
        "half_pair": (cert, None, None),
        "ca_without_cert": (None, None, str(pki.ca.cert)),
        "wrong_key": (cert, str(pki.worker.key), None),
        "garbage_cert": (str(junk), key, None),
        "garbage_ca": (cert, key, str(junk)),
    }[case]
    with pytest.raises(TLSConfigError, match=message):
        server_credentials(*kwargs)


def test_client_errors_name_the_prefixed_flag(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(TLSConfigError, match="--worker-tls-ca: no such file"):
        client_tls(ca=str(tmp_path / "x.pem"), flag_prefix="--worker-")
    with pytest.raises(TLSConfigError, match="--worker-tls-cert and --worker-tls-key go together"):
        client_tls(cert=str(pki.gateway.cert), flag_prefix="--worker-")
    with pytest.raises(TLSConfigError, match=r"--worker-tls-key .* is not the private key"):
        client_tls(cert=str(pki.gateway.cert), key=str(pki.worker.key), flag_prefix="--worker-")


# ------------------------------------------------------------------------------ handshakes
async def _serve(creds: grpc.ServerCredentials | None, health_port: int = 0) -> Server:
    server = Server(
        host="127.0.0.1",
        port=0,
        service_names=[],
        register=lambda s: None,
        credentials=creds,
        health_port=health_port,
    )
    await server.start()
    return server


async def _check(address: str, tls: ClientTLS | None, *, accepted: bool = False) -> grpc.StatusCode:
    """The status of a health check; `accepted`: the client should get in, so a handshake that a
    loaded machine delayed past the first connection attempt is waited for (a refused client
    still fails: the wait ends at the deadline, not with OK)."""
    async with make_channel(address, tls) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(),
                timeout=10 if accepted else 5,
                wait_for_ready=accepted,
            )
        except grpc.aio.AioRpcError as e:
            return e.code()
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


async def test_mutual_tls_accepts_only_clients_with_a_certificate_from_its_ca(pki: PKI) -> None:
    from tests.support.processes import free_port

    creds = server_credentials(str(pki.grammar.cert), str(pki.grammar.key), str(pki.ca.cert))
    server = await _serve(creds, health_port=free_port())
    address = f"127.0.0.1:{server.port}"
    ca = str(pki.ca.cert)
    try:
        good = client_tls(ca=ca, cert=str(pki.gateway.cert), key=str(pki.gateway.key))
        assert await _check(address, good, accepted=True) == grpc.StatusCode.OK
        # The certificate names maskwire-grammar, not the IP dialled: the override makes it match.
        named = client_tls(
            ca=ca,
            cert=str(pki.gateway.cert),
            key=str(pki.gateway.key),
            server_name="maskwire-grammar",
        )
        assert await _check(address, named, accepted=True) == grpc.StatusCode.OK
        refused = {
            "no client certificate": client_tls(ca=ca),
            "client certificate from another CA": client_tls(
                ca=ca, cert=str(pki.stranger.cert), key=str(pki.stranger.key)
            ),
            "client trusting another CA": client_tls(
                ca=str(pki.other_ca.cert), cert=str(pki.gateway.cert), key=str(pki.gateway.key)
            ),
            "wrong server name": client_tls(
                ca=ca,
                cert=str(pki.gateway.cert),
                key=str(pki.gateway.key),
                server_name="maskwire-worker",
            ),
            "plaintext": None,
        }
        for what, tls in refused.items():
            assert await _check(address, tls) == grpc.StatusCode.UNAVAILABLE, what
        # Probes: the plaintext health port answers health checks and nothing else.
        health_address = f"127.0.0.1:{server.health_port}"
        assert await _check(health_address, None) == grpc.StatusCode.OK
        async with make_channel(health_address, None) as ch:
            reflect = ch.unary_unary("/maskwire.v1.Worker/GetModelInfo")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reflect(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.drain(0)


async def test_tls_without_client_auth(pki: PKI) -> None:
    server = await _serve(server_credentials(str(pki.worker.cert), str(pki.worker.key)))
    address = f"127.0.0.1:{server.port}"
    try:
        assert await _check(address, client_tls(ca=str(pki.ca.cert))) == grpc.StatusCode.OK
        assert await _check(address, None) == grpc.StatusCode.UNAVAILABLE
        other = client_tls(ca=str(pki.other_ca.cert))
        assert await _check(address, other) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.drain(0)
