"""Bulk TCP to the server's bulk port (a gRPC stream tops out near 0.6x of one loopback TCP connection in Python): a
16-byte ticket, then the bytes (an upload ends with a one-byte ACK). The first byte waits FIRST_BYTE_TIMEOUT (a server
over its connection cap never answers)."""

from __future__ import annotations

import socket
import threading
from typing import ClassVar

import xxhash

from weightclient.core.retry import Deadline
from weightclient.transports import base
from weightclient.transports.base import Offer, Parts, Progress, Transport, TransportFailed, Uploaded, receive_buffer
from weightserver.protocol.errors import DeadlineExceeded
from weightserver.protocol.framing import Sink
from weightserver.v1 import weights_pb2 as pb

CONNECT_TIMEOUT = 2.0
FIRST_BYTE_TIMEOUT = 5.0
STALL_TIMEOUT = 30.0
SOCKET_BUFFER = 8 << 20
SEND_BLOCK = 2 << 20  # a publish hashes and sends this much at a time
ACK = b"\x01"


class BulkTransport(Transport):
    """A client's kept-open connection to a server's bulk port (one transfer at a time)."""

    name: ClassVar[str] = "bulk"
    kind: ClassVar[int] = pb.TRANSPORT_BULK

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self.port: int | None = None  # the server's bulk port this client last connected to

    def upload(self, payload: pb.Payload, parts: Parts, *, deadline: Deadline, progress: Progress | None) -> Uploaded:
        if (size := sum(part.nbytes for part in parts)) != payload.byte_size:
            raise TransportFailed(f"the server expects {payload.byte_size} bytes, not {size}")
        ack = memoryview(bytearray(1))
        xxh3 = self._transfer(payload.bulk, "an upload", deadline, ack, parts=parts, progress=progress)
        if ack != ACK:
            self.close()
            raise TransportFailed(f"the bulk port answered {bytes(ack)!r}, not its acknowledgement")
        return Uploaded(xxh3)

    def receive(self, offer: Offer, *, into: memoryview | Sink | None, progress: Progress | None) -> memoryview:
        target = into if base.is_sink(into) else receive_buffer(offer.payload.byte_size, into)
        self._transfer(offer.payload.bulk, offer.label, offer.deadline, target, progress=progress, stall=offer.stall)
        return target if isinstance(target, memoryview) else memoryview(b"")

    @property
    def connected(self) -> bool:
        return self._socket is not None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _transfer(
        self,
        bulk: pb.BulkTicket,
        label: str,
        deadline: Deadline,
        into: memoryview | Sink,
        *,
        parts: Parts = (),
        progress: Progress | None = None,
        stall: float = 0.0,
    ) -> str:
        """Send the ticket, then `parts` (each block hashed just before it goes: their xxh3), then receive `into`, each
        wait for bytes cut to `stall`. A kept connection the server closed (EOF before the first byte): tried afresh."""
        with self._lock:
            try:
                for kept in (self._socket is not None and self.port == bulk.port, False):  # (kept, then afresh)
                    if not kept:
                        self._close()
                        self._socket, self.port = _connect(self.host, bulk.port, deadline), bulk.port
                    conn = self._socket
                    try:
                        conn.settimeout(_wait(CONNECT_TIMEOUT, deadline))
                        conn.sendall(bulk.ticket)
                        hasher = xxhash.xxh3_128()
                        for block in base.blocks(parts, SEND_BLOCK, progress):
                            hasher.update(block)
                            wait = _wait(STALL_TIMEOUT, deadline)
                            conn.settimeout(wait)
                            try:
                                conn.sendall(block)
                            except TimeoutError:
                                if wait < STALL_TIMEOUT:  # cut to the caller's deadline: theirs to report
                                    what = f"the bulk port did not take the next block within {wait:.3g}s"
                                    raise DeadlineExceeded(what) from None
                                raise
                        received, sink = 0, base.is_sink(into)
                        while received < into.nbytes:
                            view = into.target(SOCKET_BUFFER) if sink else into[received : received + SOCKET_BUFFER]
                            started = received > 0 or bool(parts)  # (the ACK follows the upload's bytes)
                            limit = STALL_TIMEOUT if started else FIRST_BYTE_TIMEOUT
                            wait = _wait(min(limit, stall) if stall else limit, deadline)
                            conn.settimeout(wait)
                            try:
                                n = conn.recv_into(view)
                            except TimeoutError:
                                if wait < limit:  # cut to the caller's deadline or stall: theirs to report
                                    raise DeadlineExceeded(f"the bulk port sent nothing for {wait:.3g}s") from None
                                what = "part-way through a transfer" if started else "after the ticket"
                                raise TransportFailed(f"the bulk port sent nothing for {limit:g}s {what}") from None
                            if not n:
                                if not started:
                                    raise EOFError("the bulk connection was closed")
                                raise OSError("bulk connection closed part-way through a transfer")
                            if sink:
                                into.advance(n)
                            received += n
                            if progress is not None and not parts:
                                progress(received, into.nbytes)
                        return hasher.hexdigest()
                    except (ConnectionError, EOFError):
                        if not kept:
                            raise
            except BaseException as exc:
                self._close()  # cut part-way (an interrupt too): the connection's position is unknown
                what = f"bulk transfer of {label} with {self.host}:{bulk.port}"
                if isinstance(exc, DeadlineExceeded):
                    raise DeadlineExceeded(f"{what} ran out of time ({exc}); connection dropped") from None
                if isinstance(exc, (ValueError, OSError, EOFError)):  # ValueError: bytes off their layout
                    raise TransportFailed(f"{what} failed ({exc})") from exc
                raise

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _wait(limit: float, deadline: Deadline) -> float:
    """`limit`, cut to what is left of `deadline`; DeadlineExceeded once it passed."""
    if deadline.expired():
        raise DeadlineExceeded("the deadline passed")
    return deadline.within(limit)


def _connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    """A connection to the first of `host`'s addresses that takes one, as gRPC's channel does ("localhost"
    may be ::1 first, where a server on 0.0.0.0 does not listen); the last address's error if none."""
    found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    for i, (family, _, _, _, address) in enumerate(found):
        conn = socket.socket(family, socket.SOCK_STREAM)
        try:
            # From the first byte: the window otherwise grows from ~128 KiB (most of a few MiB's time).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_wait(CONNECT_TIMEOUT, deadline))
            conn.connect(address)
        except BaseException as exc:
            conn.close()
            if not isinstance(exc, OSError) or i == len(found) - 1:
                raise  # (an interrupt, or the last address's error)
            continue
        return conn
    raise OSError(f"{host} has no address")  # (getaddrinfo raises rather than find none)
