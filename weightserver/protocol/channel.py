"""Dialling a weight server (client and relay alike): TLS credentials and the bearer token."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

PathLike = str | os.PathLike[str]
AUTHORIZATION_METADATA_KEY = "authorization"


def channel_credentials(
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
    *,
    names: tuple[str, str, str] = ("tls_ca", "tls_cert", "tls_key"),
) -> grpc.ChannelCredentials:
    """TLS credentials trusting `tls_ca` (None: the system's roots); ValueError names the bad option."""
    ca_name, cert_name, key_name = names
    if (tls_cert is None) != (tls_key is None):
        given, missing = (cert_name, key_name) if tls_key is None else (key_name, cert_name)
        raise ValueError(f"{given} without {missing}: a client certificate needs its private key; give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls_ca, ca_name),
        private_key=read_pem(tls_key, key_name),
        certificate_chain=read_pem(tls_cert, cert_name),
    )


def read_pem(path: PathLike | None, name: str) -> bytes | None:
    """The bytes of a PEM file (None for no path); ValueError naming `name` if it is not PEM."""
    if not path:
        return None
    data = Path(path).read_bytes()
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name} {os.fspath(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def bearer_metadata(token: str) -> tuple[str, str]:
    """The call metadata that carries `token`: ``authorization: Bearer <token>``."""
    return (AUTHORIZATION_METADATA_KEY, f"Bearer {token}")
