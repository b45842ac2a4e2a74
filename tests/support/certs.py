"""Throw-away PKI for TLS tests: a CA, server and client certificates, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key on disk."""

    cert: Path
    key: Path


@dataclass
class CA:
    """A self-signed certificate authority that issues leaf certificates into `directory`."""

    name: str
    directory: Path
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    cert: Path  # the CA certificate (PEM), what a peer trusts

    @classmethod
    def create(cls, directory: Path, name: str = "maskwire-test-ca") -> CA:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        path = directory / f"{name}.crt"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(name, directory, key, cert, path)

    def issue(
        self,
        name: str,
        *,
        dns: tuple[str, ...] = ("localhost",),
        ips: tuple[str, ...] = ("127.0.0.1",),
        server: bool = True,
        client: bool = True,
    ) -> Issued:
        """A leaf certificate for `name` with the given SANs and extended key usages."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = [
            *([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
            *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []),
        ]
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = self.directory / f"{name}.crt"
        key_path = self.directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return Issued(cert_path, key_path)


@dataclass(frozen=True)
class PKI:
    """Everything a TLS test needs: the deployment's CA and leaves, plus an unrelated CA."""

    ca: CA
    grammar: Issued  # server cert of the grammar service
    worker: Issued  # server cert of the worker, also its client cert towards the grammar service
    gateway: Issued  # client cert of the gateway (and of test clients)
    other_ca: CA  # a CA nobody trusts
    stranger: Issued  # a client cert signed by other_ca


def make_pki(directory: Path) -> PKI:
    ca = CA.create(directory / "ca")
    other = CA.create(directory / "other", "maskwire-other-ca")
    return PKI(
        ca=ca,
        grammar=ca.issue("maskwire-grammar", dns=("localhost", "maskwire-grammar")),
        worker=ca.issue("maskwire-worker", dns=("localhost", "maskwire-worker")),
        gateway=ca.issue("maskwire-gateway", dns=(), ips=(), server=False),
        other_ca=other,
        stranger=other.issue("stranger", server=False),
    )
