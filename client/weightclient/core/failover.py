"""Reaching a server: channel, metadata, errors, failover among addresses ("relay:50052,primary:50051";
versions keep their numbers and bytes across a primary and its relays, so moving on is safe)."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from weightclient.core.retry import DEFAULT_RETRY, Deadline, RetryPolicy
from weightclient.transports import BulkTransport, SharedMemoryTransport, StreamTransport, TransportChain
from weightserver.protocol.channel import PathLike, bearer_metadata, channel_credentials
from weightserver.protocol.errors import (
    CLIENT_ID_METADATA_KEY,
    ERROR_METADATA_KEY,
    DeadlineExceeded,
    ServerUnavailable,
    WeightServerError,
    error_from_status,
)
from weightserver.protocol.limits import CHANNEL_OPTIONS, DEFAULT_CHUNK_BYTES, DEFAULT_PORT
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
ADDRESS_ENV = "WEIGHTSERVER_ADDRESS"
TOKEN_ENV = "WEIGHTSERVER_TOKEN"
TLS_CA_ENV = "WEIGHTSERVER_TLS_CA"
TLS_CERT_ENV = "WEIGHTSERVER_TLS_CERT"
TLS_KEY_ENV = "WEIGHTSERVER_TLS_KEY"
RETIRED_LINKS = 2  # links moved away from, kept open for calls still running on them


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or f"localhost:{DEFAULT_PORT}"


def open_channel(
    address: str,
    *,
    tls: bool | None = None,
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
) -> grpc.Channel:
    """TLS when `tls` is True or a TLS file is given (or in $WEIGHTSERVER_TLS_*); no CA: system roots."""
    tls_ca = tls_ca or os.environ.get(TLS_CA_ENV) or None
    tls_cert = tls_cert or os.environ.get(TLS_CERT_ENV) or None
    tls_key = tls_key or os.environ.get(TLS_KEY_ENV) or None
    if tls is False or (tls is None and not (tls_ca or tls_cert or tls_key)):
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = channel_credentials(tls_ca, tls_cert, tls_key)  # ValueError for half a client certificate
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def call_metadata(token: str | None, client_id: str | None) -> tuple[tuple[str, str], ...] | None:
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    metadata = [bearer_metadata(token)] if token else []
    if client_id:
        metadata.append((CLIENT_ID_METADATA_KEY, client_id))
    return tuple(metadata) or None


def error_from_rpc(err: grpc.RpcError) -> WeightServerError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return error_from_status(code, details, dict(trailing or ()).get(ERROR_METADATA_KEY))


@contextmanager
def map_rpc_errors(address: str | None = None) -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as err:
        error = error_from_rpc(err)
        if address and isinstance(error, ServerUnavailable):  # (an RpcError need not have a code())
            error = type(error)(f"weight server at {address} is unavailable: {error}")
        raise error from None


@dataclass
class ServerLink:
    address: str
    stub: Any  # pb_grpc.WeightServiceStub, or a stand-in (transports.mock)
    transports: TransportChain
    incoming_bulk: Any  # a second bulk connection: an incoming transfer lasts a whole publish
    channel: grpc.Channel | None = None

    def close(self) -> None:
        for transport in (self.transports.by_name.get("bulk"), self.incoming_bulk):
            if hasattr(transport, "close"):
                transport.close()
        if self.channel is not None:
            self.channel.close()


def host_of(address: str) -> str:
    """'localhost:50051' -> 'localhost', '[::1]:5' -> '::1'."""
    target = address.split("///", 1)[-1]
    return (target.rsplit(":", 1)[0] if ":" in target else target).strip("[]")


class Connection(AbstractContextManager):
    """The link in use among `address`es (default $WEIGHTSERVER_ADDRESS, then localhost:50051). `timeout`: the
    deadline of each call and fetch that gives none (a publish has none unless given: the server's --publish-timeout
    bounds it). `retry_seconds`: how long idempotent calls with no timeout at all (`timeout=None`) retry while no
    server answers. `connect(address) -> ServerLink` replaces the network (transports.mock); TLS: `open_channel`."""

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        *,
        timeout: float | None = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        client_id: str | None = None,
        token: str | None = None,
        retry_seconds: float = 30.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        connect: Callable[[str], ServerLink] | None = None,
        tls: bool | None = None,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
    ) -> None:
        address = address or default_address()
        self.addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address) if a.strip()]
        if not self.addresses:
            raise ValueError(f"no server address in {address!r}")
        for given in self.addresses:  # (gRPC would dial the port modulo 65536, and retry there)
            if (port := given.rpartition(":")[2]).isdigit() and not 0 < int(port) < 65536:
                raise ValueError(f"server address {given!r}: port {port} is not one (1-65535)")
        self.timeout, self.chunk_bytes, self.retry_seconds, self.retry = timeout, chunk_bytes, retry_seconds, retry
        # What a client like this one in another process is made with (a pickled updater dials again).
        self.settings: dict[str, Any] = dict(
            timeout=timeout,
            chunk_bytes=chunk_bytes,
            client_id=client_id,
            token=token,
            retry_seconds=retry_seconds,
            retry=retry,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        self._metadata = call_metadata(token, client_id)
        self._shm = SharedMemoryTransport()

        def dial(address: str) -> ServerLink:
            channel = open_channel(address, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
            stream = StreamTransport(channel, self._metadata, chunk_bytes)
            chain = TransportChain([self._shm, BulkTransport(host_of(address))], stream)
            stub = pb_grpc.WeightServiceStub(channel)
            return ServerLink(address, stub, chain, BulkTransport(host_of(address)), channel)

        self._connect = connect or dial
        self._lock = threading.Lock()
        self._turns = itertools.cycle(self.addresses)  # the address to move on to next, in turn
        self._link = self._connect(next(self._turns))
        self._retired: list[ServerLink] = []

    @property
    def address(self) -> str:
        return self._link.address

    @property
    def transports(self) -> TransportChain:
        return self._link.transports

    @transports.setter
    def transports(self, chain: TransportChain) -> None:
        self._link.transports = chain

    def _move_on(self, failed: str, why: object) -> bool:
        """Use the address after `failed` (unless another thread did); False if none."""
        if len(self.addresses) == 1:
            return False
        with self._lock:
            if self._link.address != failed:
                return True
            self._retired.append(self._link)  # calls still running on it end on their own
            self._link = self._connect(next(self._turns))
            while len(self._retired) > RETIRED_LINKS:
                self._retired.pop(0).close()
        log.warning("server %s is down or stalled (%s); moving to %s", failed, why, self._link.address)
        return True

    def _negotiate(self, timeout: float | None, accept: list[int], **asked: Any) -> pb.NegotiateResponse:
        """A Negotiate call for `fetch=` a pb.FetchRequest or `publish=` a pb.PublishHeader."""
        direction = pb.DIRECTION_FETCH if "fetch" in asked else pb.DIRECTION_PUBLISH
        request = pb.NegotiateRequest(direction=direction, accept=accept, **asked)
        return self._link.stub.Negotiate(request, timeout=timeout, metadata=self._metadata)

    def _call(
        self, method: str, request: object, *, retry: bool = True, timeout: float | None = None, change: bool = False
    ) -> Any:
        """A unary call by name. A `change` (delete, pin) is made once, on the server in use."""

        def once(deadline: Deadline) -> Any:
            with map_rpc_errors(self.address):
                return getattr(self._link.stub, method)(request, timeout=deadline.remaining(), metadata=self._metadata)

        deadline = self._deadline(timeout)
        return once(deadline) if change else self._on_any_server(once, deadline, retry=retry)

    def _deadline(self, timeout: float | None) -> Deadline:
        """A call's deadline: its own `timeout`, else the client's."""
        return Deadline.after(self.timeout if timeout is None else timeout)

    def _on_any_server(self, call: Callable[[Deadline], T], deadline: Deadline, *, retry: bool) -> T:
        """`call(deadline)`, moving on from a server that is down (at once the first time); without
        `retry`, the first address gets half the deadline (a stalled one leaves the next some) and one more the rest."""
        if retry and deadline.at is None:
            deadline = Deadline.after(self.retry_seconds)
        errors = self.retry.retry_on if retry else (ServerUnavailable, DeadlineExceeded)
        left = deadline.remaining()
        first = deadline if retry or left is None or len(self.addresses) == 1 else Deadline.after(left / 2)
        for attempt in itertools.count():
            address = self.address
            try:
                return call(first if attempt == 0 else deadline)
            except errors as exc:
                if not retry:
                    if attempt or deadline.expired() or not self._move_on(address, exc):
                        raise
                elif not (self._move_on(address, exc) and attempt == 0):
                    if attempt == 0:
                        log.warning(
                            "%s: %s; retrying for up to %.1fs", address, type(exc).__name__, deadline.remaining()
                        )
                    if not self.retry.wait(attempt, deadline):
                        raise

    def close(self) -> None:
        with self._lock:
            links, self._retired = [self._link, *self._retired], []
        for link in links:
            link.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r})"
