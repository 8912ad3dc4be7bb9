"""Bulk TCP: a payload over a plain TCP connection to the server's bulk port, beside gRPC.

A gRPC stream of 1 MiB messages tops out near 0.6x of one loopback TCP connection in Python,
so a fetch may get a ticket instead: the client sends its 16 bytes on a kept-open connection
and receives exactly the payload's bytes with `recv_into`, straight into its buffer or into
the placed tensors. A publish's ticket goes the other way: the client sends the ticket, then
the file's bytes straight from the tensors (hashing each block just before it goes, while it
is in cache), and waits for the server's one-byte ACK that every byte is in.

Every recv waits at most what is left of the fetch's deadline (DeadlineExceeded), and at most
FIRST_BYTE_TIMEOUT for the first byte after the ticket (a server that reads a ticket sends at
once; one that does not, e.g. over its connection cap, sends the fetch to the stream) or
STALL_TIMEOUT between bytes. A connection that timed out is dropped: where its stream stands
is unknown.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, TypeVar

import xxhash

from weightclient.core.retry import Deadline
from weightclient.placement import PlacedReceiver
from weightclient.transports.base import Offer, Progress, TransportFailed, negotiated_offer, receive_buffer
from weightserver.protocol.errors import DeadlineExceeded
from weightserver.protocol.framing import BufferSink, Sink
from weightserver.v1 import weights_pb2 as pb

CONNECT_TIMEOUT = 2.0
FIRST_BYTE_TIMEOUT = 5.0
STALL_TIMEOUT = 30.0
SOCKET_BUFFER = 8 << 20
SEND_BLOCK = 2 << 20  # a publish hashes and sends this much at a time
ACK = b"\x01"
T = TypeVar("T")


class BulkTransport:
    """A client's kept-open connection to a server's bulk port (one transfer at a time)."""

    name: ClassVar[str] = "bulk"
    written_in_place: ClassVar[bool] = False
    kind: ClassVar[int] = pb.TRANSPORT_BULK

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._port: int | None = None

    def upload(
        self, payload: pb.Payload, parts: Sequence[memoryview], *, deadline: Deadline, progress: Progress | None
    ) -> str:
        total = payload.byte_size
        if sum(part.nbytes for part in parts) != total:
            raise TransportFailed(f"the server expects {total} bytes, not {sum(p.nbytes for p in parts)}")

        def send(conn: socket.socket) -> str:
            hasher = xxhash.xxh3_128()
            sent = 0
            for part in parts:
                for start in range(0, part.nbytes, SEND_BLOCK):
                    block = part[start : start + SEND_BLOCK]
                    hasher.update(block)
                    conn.settimeout(_wait(STALL_TIMEOUT, deadline))
                    conn.sendall(block)
                    sent += block.nbytes
                    if progress is not None:
                        progress(sent, total)
            ack = bytearray(1)
            if _recv_some(conn, memoryview(ack), started=True, deadline=deadline) != 1 or ack != ACK:
                raise OSError(f"the bulk port answered {bytes(ack)!r}, not its acknowledgement")
            return hasher.hexdigest()

        return self._transfer(payload.bulk.port, payload.bulk.ticket, "an upload", deadline, send)

    def prepare(self, payload: pb.Payload) -> None:
        pass  # the server set the buffer up; the kept connection is ready

    def release(self, payload: pb.Payload) -> None:
        pass

    offer = staticmethod(negotiated_offer)

    def receive(self, offer: Offer, *, into: memoryview | None, progress: Progress | None) -> memoryview:
        buffer = receive_buffer(offer.payload.byte_size, into)
        self._fill(offer, BufferSink(buffer), progress)
        return buffer

    def receive_placed(self, offer: Offer, views: Mapping[str, memoryview]) -> list[str]:
        receiver = PlacedReceiver(offer.info, views)
        self._fill(offer, receiver, None)
        return receiver.bad()

    @property
    def connected(self) -> bool:
        """Whether a connection is kept open for the next transfer."""
        return self._socket is not None

    @property
    def port(self) -> int | None:
        """The server's bulk port this client last connected to."""
        return self._port

    def _fill(self, offer: Offer, sink: Sink, progress: Progress | None) -> None:
        """Receive the offered payload into `sink`, after sending the ticket."""
        size = offer.payload.byte_size

        def fill(conn: socket.socket) -> None:
            received = 0
            try:
                while not sink.done:
                    n = _recv_some(conn, sink.target(SOCKET_BUFFER), started=received > 0, deadline=offer.deadline)
                    sink.advance(n)
                    received += n
                    if progress is not None:
                        progress(received, size)
            except ValueError as exc:
                raise TransportFailed(f"bulk payload of {offer.label} does not match its description: {exc}") from exc

        self._transfer(offer.payload.bulk.port, offer.payload.bulk.ticket, offer.label, offer.deadline, fill)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _transfer(
        self, port: int, ticket: bytes, label: str, deadline: Deadline, exchange: Callable[[socket.socket], T]
    ) -> T:
        """Send `ticket` on the kept connection to `port` (a fresh one if needed), then let
        `exchange` move the bytes."""
        with self._lock:
            fresh = self._socket is None or self._port != port
            try:
                try:
                    return self._send_ticket(port, ticket, exchange, deadline)
                except (ConnectionError, EOFError):
                    self._close()
                    if fresh:
                        raise
                # A kept connection the server closed meanwhile: the ticket is unused, try afresh.
                return self._send_ticket(port, ticket, exchange, deadline)
            except (OSError, EOFError) as exc:
                self._close()
                raise TransportFailed(f"bulk transfer of {label} with {self.host}:{port} failed ({exc})") from exc
            except DeadlineExceeded as exc:
                self._close()
                raise DeadlineExceeded(
                    f"bulk transfer of {label} with {self.host}:{port} did not finish within the call's "
                    f"timeout ({exc}); the connection was dropped"
                ) from None
            except BaseException:
                self._close()  # a timeout or an interrupt part-way: the connection's position is unknown
                raise

    def _send_ticket(self, port: int, ticket: bytes, read: Callable[[socket.socket], T], deadline: Deadline) -> T:
        if self._socket is None or self._port != port:
            self._close()
            self._socket = _connect(self.host, port, deadline)
            self._port = port
        self._socket.settimeout(_wait(CONNECT_TIMEOUT, deadline))
        self._socket.sendall(ticket)
        return read(self._socket)

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _wait(limit: float, deadline: Deadline) -> float:
    """`limit`, or what is left of `deadline` if that is less; DeadlineExceeded once it passed."""
    if deadline.expired():
        raise DeadlineExceeded("the deadline passed")
    return deadline.within(limit)


def _recv_some(conn: socket.socket, view: memoryview, *, started: bool, deadline: Deadline) -> int:
    """recv_into `view`; EOFError if the peer closed before the first byte of a transfer (a
    kept connection the server dropped), OSError if it closed part-way, TransportFailed if it
    sent nothing for FIRST_BYTE_TIMEOUT (before the first byte) or STALL_TIMEOUT (after),
    DeadlineExceeded once `deadline` passed."""
    limit = STALL_TIMEOUT if started else FIRST_BYTE_TIMEOUT
    wait = _wait(limit, deadline)
    conn.settimeout(wait)
    try:
        n = conn.recv_into(view)
    except TimeoutError:
        if wait < limit:
            raise DeadlineExceeded(f"no bytes for the last {wait:.1f}s") from None
        what = "part-way through a transfer" if started else "after the ticket"
        raise TransportFailed(f"the bulk port sent nothing for {limit:g}s {what}") from None
    if not n:
        if not started:
            raise EOFError("the bulk connection was closed")
        raise OSError("bulk connection closed part-way through a transfer")
    return n


def _connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
    conn = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A large receive buffer from the first byte: a fresh connection's window otherwise
        # grows from ~128 KiB, which dominates a transfer of a few MiB.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(_wait(CONNECT_TIMEOUT, deadline))
        conn.connect(address)
    except BaseException:
        conn.close()
        raise
    return conn
