"""BulkEndpoint: large payloads over a plain TCP connection beside the gRPC control path.

A gRPC stream of 1 MiB messages tops out near 0.6x of what one loopback TCP connection
carries (see REFERENCE.md), so a fetch may instead get a single-use ticket: the client sends
the 16-byte ticket on its connection to the bulk port and receives exactly the payload's
bytes straight into its buffer (`sendall` of the server's memoryview, `recv_into` on the
client). A client keeps its connection for the next ticket. Tickets are random, expire, and
name one payload; an unknown ticket gets the connection closed with nothing sent.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

TICKET_BYTES = 16
TICKET_TTL_SECONDS = 60.0
SOCKET_BUFFER = 8 << 20  # a fresh connection's window otherwise starts small
IDLE_CONNECTION_SECONDS = 600.0


@dataclass
class _Pending:
    data: memoryview
    expires: float
    label: str


class BulkEndpoint:
    """Serves ticketed payloads on `host:port` (port 0 picks a free one) from a thread."""

    def __init__(self, host: str, port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(128)
        self.port: int = self._socket.getsockname()[1]
        self._tickets: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="weightserver-bulk", daemon=True)
        self._thread.start()

    def issue(self, data: bytes | bytearray | memoryview, label: str = "") -> bytes:
        """A ticket that delivers `data` once, within TICKET_TTL_SECONDS."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for key in [k for k, p in self._tickets.items() if p.expires < now]:
                del self._tickets[key]
            self._tickets[ticket] = _Pending(memoryview(data).cast("B"), now + TICKET_TTL_SECONDS, label)
        return ticket

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._socket.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), name="weightserver-bulk-send", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        """Answer tickets on one connection until the client closes it (clients keep theirs
        open, so a transfer starts with a warm window instead of a TCP handshake)."""
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IDLE_CONNECTION_SECONDS)
            while not self._closed:
                try:
                    ticket = _recv_exactly(conn, TICKET_BYTES)
                except (OSError, EOFError):
                    return  # the client closed its connection, or it sat idle too long
                with self._lock:
                    pending = self._tickets.pop(ticket, None)
                if pending is None or pending.expires < time.monotonic():
                    log.warning("bulk: unknown or expired ticket from %s", peer)
                    return
                started = time.perf_counter()
                try:
                    conn.sendall(pending.data)
                except OSError as exc:
                    log.warning("bulk: transfer to %s failed: %s", peer, exc)
                    return
                seconds = time.perf_counter() - started
                log.debug(
                    "bulk: sent %s (%d bytes) to %s in %.1f ms", pending.label, pending.data.nbytes, peer, seconds * 1e3
                )


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise EOFError("connection closed before a ticket arrived")
        data += part
    return bytes(data)
