"""Throwaway TLS certificates for tests, made at run time: a CA, a server certificate for
127.0.0.1/localhost, a client certificate from the same CA and one from an unrelated CA."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_pki(d: Path) -> dict[str, Path]:
    """PEM files in `d`: ca, other_ca, server_cert/_key, client_cert/_key, stranger_cert/_key."""
    ca_key, other_ca_key = _key(), _key()
    ca = _cert("test-ca", ca_key, "test-ca", ca_key, ca=True)
    other_ca = _cert("other-ca", other_ca_key, "other-ca", other_ca_key, ca=True)
    server_key, client_key, stranger_key = _key(), _key(), _key()
    files = {
        "ca": _write(d / "ca.pem", ca),
        "other_ca": _write(d / "other-ca.pem", other_ca),
        "server_cert": _write(d / "server.pem", _cert("server", server_key, "test-ca", ca_key, ca=False, server=True)),
        "server_key": _write(d / "server.key", key=server_key),
        "client_cert": _write(d / "client.pem", _cert("collector", client_key, "test-ca", ca_key, ca=False)),
        "client_key": _write(d / "client.key", key=client_key),
        "stranger_cert": _write(d / "stranger.pem", _cert("x", stranger_key, "other-ca", other_ca_key, ca=False)),
        "stranger_key": _write(d / "stranger.key", key=stranger_key),
    }
    return files


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, *, ca: bool, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    os.chmod(path, 0o600)
    return path
