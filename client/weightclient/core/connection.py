"""How a client reaches a server: the channel (plaintext or TLS), the call metadata (bearer
token, client id), and retrying idempotent calls while the server is unavailable."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from weightserver.protocol.channel import bearer_metadata, channel_credentials
from weightserver.protocol.errors import CLIENT_ID_METADATA_KEY, ServerUnavailable
from weightserver.protocol.limits import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

TOKEN_ENV = "WEIGHTSERVER_TOKEN"
TLS_CA_ENV = "WEIGHTSERVER_TLS_CA"
TLS_CERT_ENV = "WEIGHTSERVER_TLS_CERT"
TLS_KEY_ENV = "WEIGHTSERVER_TLS_KEY"

RETRY_FIRST_DELAY = 0.05
RETRY_MAX_DELAY = 2.0

T = TypeVar("T")
PathLike = str | os.PathLike[str]


def open_channel(
    address: str,
    *,
    tls: bool | None = None,
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
) -> grpc.Channel:
    """A channel to `address`: TLS when `tls` is True or any TLS file is given (arguments,
    else $WEIGHTSERVER_TLS_CA / _CERT / _KEY), plaintext otherwise. Without a CA the system's
    roots are trusted; a client certificate and key are for servers that demand mutual TLS."""
    tls_ca = tls_ca or os.environ.get(TLS_CA_ENV) or None
    tls_cert = tls_cert or os.environ.get(TLS_CERT_ENV) or None
    tls_key = tls_key or os.environ.get(TLS_KEY_ENV) or None
    if tls is False or (tls is None and not (tls_ca or tls_cert or tls_key)):
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = channel_credentials(tls_ca, tls_cert, tls_key)  # ValueError for half a client certificate
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def call_metadata(token: str | None, client_id: str | None) -> tuple[tuple[str, str], ...] | None:
    """Metadata sent with every call: the bearer token ($WEIGHTSERVER_TOKEN when not given)
    and the client id."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    metadata = []
    if token:
        metadata.append(bearer_metadata(token))
    if client_id:
        metadata.append((CLIENT_ID_METADATA_KEY, client_id))
    return tuple(metadata) or None


def remaining(deadline: float | None) -> float | None:
    """Seconds left until `deadline` (a time.monotonic() reading), at least 0; None for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def retry_unavailable(
    call: Callable[[float | None], T],
    timeout: float | None,
    what: str,
    *,
    move_on: Callable[[ServerUnavailable], bool] | None = None,
) -> T:
    """Run `call(remaining_timeout)`, retrying while it raises ServerUnavailable, with
    exponential backoff and jitter, until `timeout` seconds have passed (forever if None).
    Only for idempotent calls: a retried call must not do anything twice. `move_on(error)`, for
    a client of several addresses, moves it to the next one: tried at once after the first
    failure, then one per retry."""
    deadline = None if timeout is None else time.monotonic() + timeout
    attempt = 0
    while True:
        try:
            return call(remaining(deadline))
        except ServerUnavailable as exc:
            if move_on is not None and move_on(exc) and attempt == 0:
                attempt += 1
                continue
            delay = backoff_delay(attempt)
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise
            if attempt == 0:
                log.warning("%s: server unavailable; retrying for up to %ss", what, timeout)
            attempt += 1
            time.sleep(delay)


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before retry `attempt` (0-based): doubling from 50 ms up to 2 s, with
    jitter so that many clients do not come back in step."""
    return min(RETRY_MAX_DELAY, RETRY_FIRST_DELAY * 2**attempt) * (0.5 + random.random())
