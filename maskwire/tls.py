"""TLS and mutual TLS for every gRPC hop: CLI flags, validated credentials, channels.

Servers (`grammar-service`, `worker`) take `--tls-cert` / `--tls-key` (TLS) and `--tls-client-ca`
(mutual TLS: clients must present a certificate that CA signed). Clients take a prefixed set, e.g.
`--grammar-tls-ca`, `--grammar-tls-cert`, `--grammar-tls-key`, `--grammar-tls-server-name` for the
worker's channels to the grammar service. Files are read and checked once at start-up (exists,
parses, key matches certificate); a certificate rotation needs a restart.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maskwire.config import ConfigError

if TYPE_CHECKING:  # grpc is imported where credentials are built: CLI modules stay light
    import grpc

ChannelOption = tuple[str, Any]


class TLSConfigError(ConfigError):
    """TLS flags that cannot work (missing file, unparsable PEM, key not matching, half a pair)."""


# ---------------------------------------------------------------------------------------- checks
def _read(path: str, flag: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise TLSConfigError(f"{flag}: no such file: {path}")
    try:
        return p.read_bytes()
    except OSError as e:
        raise TLSConfigError(f"{flag}: cannot read {path}: {e.strerror}") from e


def _no_password() -> str:
    raise TLSConfigError("encrypted private keys are not supported")


def _check_pair(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    """The certificate chain and key parse and belong together (Python's OpenSSL checks it)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except TLSConfigError as e:
        raise TLSConfigError(f"{key_flag} {key}: {e}") from None
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise TLSConfigError(
                f"{key_flag} {key} is not the private key of {cert_flag} {cert}"
            ) from None
        raise TLSConfigError(
            f"{cert_flag} {cert} / {key_flag} {key}: not a PEM certificate and private key "
            f"({e.reason or e})"
        ) from None


def _check_ca(path: str, flag: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise TLSConfigError(
            f"{flag} {path}: no PEM CA certificate found ({e.reason or e})"
        ) from None


# ---------------------------------------------------------------------------------------- server
def add_server_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-client-ca` and `--health-port` for a gRPC server."""
    g = parser.add_argument_group("TLS (certificates are read at start-up only)")
    g.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS")
    g.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="PEM CA bundle: require clients to present a certificate it signed (mutual TLS)",
    )
    g.add_argument(
        "--health-port",
        type=int,
        default=0,
        metavar="PORT",
        help="extra plaintext port serving only grpc.health.v1, for probes that cannot speak "
        "TLS (Kubernetes gRPC probes); 0: none (default)",
    )


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None = None
) -> grpc.ServerCredentials | None:
    """Checked server credentials: None without a certificate (plaintext), mTLS with a client CA."""
    import grpc

    if not cert and not key:
        if client_ca:
            raise TLSConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not cert or not key:
        raise TLSConfigError("--tls-cert and --tls-key go together")
    chain = _read(cert, "--tls-cert")
    pair = [(_read(key, "--tls-key"), chain)]
    _check_pair(cert, key, "--tls-cert", "--tls-key")
    if not client_ca:
        return grpc.ssl_server_credentials(pair)
    roots = _read(client_ca, "--tls-client-ca")
    _check_ca(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials(pair, root_certificates=roots, require_client_auth=True)


def server_credentials_from_args(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """Credentials from `add_server_tls_arguments` flags; raises `TLSConfigError`."""
    return server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)


# ---------------------------------------------------------------------------------------- client
@dataclass(frozen=True)
class ClientTLS:
    """Channel credentials plus the name the server certificate must carry (when not the host)."""

    credentials: grpc.ChannelCredentials
    server_name: str = ""

    def channel_options(self) -> list[ChannelOption]:
        # Replicas are dialled by IP (DNS expansion): check the certificate against a fixed name.
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def client_tls(
    *,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
    enabled: bool = False,
    flag_prefix: str = "--",
) -> ClientTLS | None:
    """Checked client TLS; None (plaintext) unless `enabled` or any file or name is given.

    Without `ca` the system's root certificates are trusted; `cert` + `key` are the client
    certificate an mTLS server asks for.
    """
    import grpc

    if not (enabled or ca or cert or key or server_name):
        return None
    f = flag_prefix
    roots = None
    if ca:
        roots = _read(ca, f"{f}tls-ca")
        _check_ca(ca, f"{f}tls-ca")
    chain = private = None
    if cert or key:
        if not cert or not key:
            raise TLSConfigError(f"{f}tls-cert and {f}tls-key go together")
        chain, private = _read(cert, f"{f}tls-cert"), _read(key, f"{f}tls-key")
        _check_pair(cert, key, f"{f}tls-cert", f"{f}tls-key")
    creds = grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=private, certificate_chain=chain
    )
    return ClientTLS(creds, server_name or "")


def add_client_tls_arguments(parser: argparse.ArgumentParser, prefix: str, peer: str) -> None:
    """`--{prefix}-tls`, `-tls-ca`, `-tls-cert`, `-tls-key`, `-tls-server-name` for channels to
    `peer` (e.g. prefix "grammar", peer "the grammar service")."""
    g = parser.add_argument_group(f"TLS to {peer} (certificates are read at start-up only)")
    f = f"--{prefix}-"
    g.add_argument(
        f"{f}tls",
        action="store_true",
        help=f"use TLS to {peer} (implied by any other {f}tls-* flag); without {f}tls-ca the "
        "system's root certificates are trusted",
    )
    g.add_argument(f"{f}tls-ca", metavar="FILE", help=f"PEM CA bundle that signed {peer}'s cert")
    g.add_argument(
        f"{f}tls-cert", metavar="FILE", help=f"PEM client certificate, when {peer} requires mTLS"
    )
    g.add_argument(f"{f}tls-key", metavar="FILE", help=f"PEM private key of {f}tls-cert")
    g.add_argument(
        f"{f}tls-server-name",
        metavar="NAME",
        help=f"name {peer}'s certificate must carry (default: the host dialled; set it when "
        "replicas are dialled by IP, e.g. through dns:///)",
    )


def client_tls_from_args(args: argparse.Namespace, prefix: str) -> ClientTLS | None:
    """ClientTLS from `add_client_tls_arguments(parser, prefix, ...)` flags; raises
    `TLSConfigError`."""
    a = prefix.replace("-", "_")
    return client_tls(
        ca=getattr(args, f"{a}_tls_ca"),
        cert=getattr(args, f"{a}_tls_cert"),
        key=getattr(args, f"{a}_tls_key"),
        server_name=getattr(args, f"{a}_tls_server_name"),
        enabled=getattr(args, f"{a}_tls"),
        flag_prefix=f"--{prefix}-",
    )


def _options(tls: ClientTLS | None, options: Sequence[ChannelOption] | None) -> list[ChannelOption]:
    return [*(options or ()), *(tls.channel_options() if tls is not None else ())]


def make_channel(
    address: str, tls: ClientTLS | None, options: Sequence[ChannelOption] | None = None
) -> grpc.aio.Channel:
    """An asyncio channel: TLS with `tls`, plaintext with None."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(address, options=_options(None, options))
    return grpc.aio.secure_channel(address, tls.credentials, options=_options(tls, options))


def make_sync_channel(
    address: str, tls: ClientTLS | None, options: Sequence[ChannelOption] | None = None
) -> grpc.Channel:
    """A blocking channel (CLI tools, probes): TLS with `tls`, plaintext with None."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address, options=_options(None, options))
    return grpc.secure_channel(address, tls.credentials, options=_options(tls, options))
