"""BulkEndpoint: large payloads over a plain TCP connection beside the gRPC control path.

A gRPC stream of 1 MiB messages tops out near 0.6x of what one loopback TCP connection
carries (see REFERENCE.md), so a fetch may instead get a single-use ticket: the client sends
the 16-byte ticket on its connection to the bulk port and receives exactly the payload's
bytes straight into its buffer (`send` of the server's memoryview, `recv_into` on the
client). A client keeps its connection for the next ticket. Tickets are random, expire, and
name one payload; an unknown ticket gets the connection closed with nothing sent.

The port is unauthenticated (a ticket is the capability), so what one peer can hold is
bounded: a few asyncio event loops, each in its own thread (LOOPS: one per core, at most 8,
since a send's copy into the kernel costs the sending thread's CPU), serve every connection;
there is no thread per connection. At most `max_connections` are open, and one over the cap
is reset at once (the client falls back to the gRPC stream); a new connection must send its
ticket within FIRST_TICKET_SECONDS, a kept one its next within IDLE_CONNECTION_SECONDS, and
a reader that takes nothing for SEND_STALL_SECONDS is dropped. An accept that fails (out of
file descriptors) is retried; nothing stops the loops but close().
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TICKET_BYTES = 16
ACK = b"\x01"  # an upload's bytes are all in
HASH_STRETCH = 1 << 20  # an upload's bytes are handed on (hashed) once this many more are in
YIELD_STRETCH = 16 << 20
TICKET_TTL_SECONDS = 60.0
SOCKET_BUFFER = 8 << 20  # a fresh connection's window otherwise starts small
DEFAULT_MAX_CONNECTIONS = 256
FIRST_TICKET_SECONDS = 10.0
IDLE_CONNECTION_SECONDS = 120.0
SEND_STALL_SECONDS = 30.0
ACCEPT_RETRY_SECONDS = (0.05, 1.0)  # after a failed accept: first pause, longest pause
REFUSED_LOG_SECONDS = 60.0  # at most one warning this often about connections over the cap
LOOPS = min(8, os.cpu_count() or 1)


@dataclass
class _Pending:
    data: memoryview
    expires: float
    label: str
    # An upload ticket: the bytes come the other way, into `data`; `arrived(n)` as the first n
    # are in, `done(error)` at the end (None: all in, acknowledged with ACK).
    arrived: Callable[[int], None] | None = None
    done: Callable[[BaseException | None], None] | None = None
    # A fetch of bytes still arriving (cut-through): `landed(sent, timeout)` waits until more
    # than `sent` of `data` are in place and says how many (it raises once they never will be).
    landed: Callable[[int, float], Awaitable[int]] | None = None


class BulkEndpoint:
    """Serves ticketed payloads on `host:port` (port 0 picks a free one) from LOOPS threads."""

    def __init__(self, host: str, port: int = 0, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by accepted connections: an upload's window is large from its first byte.
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self._socket.bind((host, port))
        self._socket.listen(1024)
        self._socket.setblocking(False)
        self.port: int = self._socket.getsockname()[1]
        self.max_connections = max_connections
        self._tickets: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()  # guards the tickets and each loop's connection count
        self.refused = 0  # connections reset at once because `max_connections` were open
        self._refused_logged = (0, -REFUSED_LOG_SECONDS)  # (refused, when) at the last warning
        self._loops = [_Loop(f"weightserver-bulk-{i}") for i in range(LOOPS)]
        self._loops[0].start(self._accept_loop)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return sum(loop.connections for loop in self._loops)

    def issue(self, data: bytes | bytearray | memoryview, label: str = "") -> bytes:
        """A ticket that delivers `data` once, within TICKET_TTL_SECONDS."""
        return self._issue(_Pending(memoryview(data).cast("B"), time.monotonic() + TICKET_TTL_SECONDS, label))

    def issue_arriving(self, data: memoryview, label: str, landed: Callable[[int, float], Awaitable[int]]) -> bytes:
        """A ticket that delivers `data` once, within TICKET_TTL_SECONDS, each part as soon as
        `landed` says it is in place; the connection is closed short if `landed` raises."""
        expires = time.monotonic() + TICKET_TTL_SECONDS
        return self._issue(_Pending(data.cast("B"), expires, label, landed=landed))

    def issue_upload(
        self,
        into: memoryview,
        label: str,
        arrived: Callable[[int], None],
        done: Callable[[BaseException | None], None],
    ) -> bytes:
        """A ticket for a publisher to send exactly `into.nbytes` bytes into `into`, once,
        within TICKET_TTL_SECONDS. `arrived(n)` is called on this endpoint's thread as the
        first n bytes are in (it may raise to stop the transfer), `done(error)` once at the end."""
        expires = time.monotonic() + TICKET_TTL_SECONDS
        return self._issue(_Pending(into.cast("B"), expires, label, arrived, done))

    def _issue(self, pending: _Pending) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._drop_expired()
        with self._lock:
            self._tickets[ticket] = pending
        # Dropped once expired even if no ticket follows: an unused one holds its bytes (a
        # whole version, perhaps evicted meanwhile) until it is dropped.
        self._loops[0].call_later(pending.expires - time.monotonic() + 0.1, self._drop_expired)
        return ticket

    def _drop_expired(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, p in self._tickets.items() if p.expires < now]:
                expired = self._tickets.pop(key)
                if expired.done is not None:
                    expired.done(TimeoutError("the upload ticket expired unused"))

    def close(self) -> None:
        """Stop accepting, drop every connection (a transfer in flight is cut) and the port."""
        for loop in self._loops:
            loop.stop()
        self._socket.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        pause = ACCEPT_RETRY_SECONDS[0]
        while True:
            try:
                conn, peer = await loop.sock_accept(self._socket)
            except Exception as exc:  # EMFILE, ENFILE, ENOBUFS, ...: keep serving
                first = pause == ACCEPT_RETRY_SECONDS[0]  # of a run of failures: warn once per run
                log.log(logging.WARNING if first else logging.DEBUG, "bulk: accept failed (%s); retrying", exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, ACCEPT_RETRY_SECONDS[1])
                continue
            pause = ACCEPT_RETRY_SECONDS[0]
            with self._lock:
                # The least busy loop takes it; kept connections stay where they landed.
                target = min(self._loops, key=lambda candidate: candidate.connections)
                full = sum(candidate.connections for candidate in self._loops) >= self.max_connections
                if not full:
                    target.connections += 1
            if full:
                # Reset, not closed: the client hears at once, and this side keeps no TIME_WAIT.
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                self._refuse(peer)
                continue
            try:
                target.start(self._serve_connection, conn, peer, target)
            except Exception:  # the loop is closing, or out of memory: drop this one, keep accepting
                self._closed(conn, target)
                log.exception("bulk: could not serve a connection from %s", peer)

    def _refuse(self, peer: object) -> None:
        self.refused += 1
        logged, when = self._refused_logged
        now = time.monotonic()
        if now - when >= REFUSED_LOG_SECONDS:
            log.warning(
                "bulk: %d connections open, the most --bulk-max-connections allows; reset %d new one(s) "
                "since the last warning (the latest from %s): those clients fetch over the gRPC stream",
                self.connections,
                self.refused - logged,
                peer,
            )
            self._refused_logged = (self.refused, now)

    def _closed(self, conn: socket.socket, loop: _Loop) -> None:
        conn.close()
        with self._lock:
            loop.connections -= 1

    async def _serve_connection(self, conn: socket.socket, peer: object, owner: _Loop) -> None:
        """Answer tickets on one connection until the client closes it or sits idle too long
        (clients keep theirs open, so a transfer starts with a warm window instead of a TCP
        handshake)."""
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wait = FIRST_TICKET_SECONDS
            ticket = bytearray(TICKET_BYTES)
            while True:
                # The last transfer's bytes are not held while the connection waits for its next
                # ticket: their version may be evicted meanwhile, and its memory must go with it.
                pending = None
                try:
                    async with asyncio.timeout(wait):
                        await _recv_exactly(loop, conn, memoryview(ticket))
                except (OSError, EOFError, TimeoutError):
                    return  # the client closed its connection, or sent no ticket in time
                with self._lock:
                    pending = self._tickets.pop(bytes(ticket), None)
                if pending is None or pending.expires < time.monotonic():
                    log.warning("bulk: unknown or expired ticket from %s", peer)
                    if pending is not None and pending.done is not None:
                        pending.done(TimeoutError("the upload ticket expired before it was used"))
                    return
                started = time.perf_counter()
                if pending.done is not None:
                    if not await self._receive_upload(loop, conn, peer, pending):
                        return
                    wait = IDLE_CONNECTION_SECONDS
                    continue
                try:
                    if pending.landed is None:
                        await _send_all(loop, conn, pending.data)
                    else:
                        await _send_as_landed(loop, conn, pending.data, pending.landed)
                except TimeoutError:
                    log.warning(
                        "bulk: transfer of %s to %s stalled: nothing moved for %gs; dropped",
                        pending.label,
                        peer,
                        SEND_STALL_SECONDS,
                    )
                    return
                except Exception as exc:  # a reset; or bytes still arriving whose publish failed
                    log.warning("bulk: transfer of %s to %s failed: %s", pending.label, peer, exc)
                    return
                seconds = time.perf_counter() - started
                log.debug(
                    "bulk: sent %s (%d bytes) to %s in %.1f ms", pending.label, pending.data.nbytes, peer, seconds * 1e3
                )
                wait = IDLE_CONNECTION_SECONDS
        finally:
            self._closed(conn, owner)

    async def _receive_upload(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, peer: object, pending: _Pending
    ) -> bool:
        """Receive an upload's bytes and acknowledge them; whether the connection may carry
        another ticket (not after a failure: where its stream stands is unknown)."""
        assert pending.arrived is not None and pending.done is not None
        started = time.perf_counter()
        try:
            await _receive_all(loop, conn, pending.data, pending.arrived)
        except Exception as exc:  # a stall, a reset, bytes that are no safetensors file, ...
            log.warning("bulk: upload of %s from %s failed: %s", pending.label, peer, exc)
            pending.done(exc)
            return False
        except BaseException as exc:  # cancelled: the server stops
            pending.done(exc)
            raise
        pending.done(None)  # before the ACK: the publisher's next call may name the upload at once
        try:
            await loop.sock_sendall(conn, ACK)
        except OSError as exc:
            log.warning("bulk: could not acknowledge the upload of %s to %s: %s", pending.label, peer, exc)
            return False
        seconds = time.perf_counter() - started
        log.debug(
            "bulk: received %s (%d bytes) from %s in %.1f ms", pending.label, pending.data.nbytes, peer, seconds * 1e3
        )
        return True


class _Loop:
    """An asyncio event loop in its own thread, and the tasks started on it."""

    def __init__(self, name: str) -> None:
        self.connections = 0  # handed to this loop and not closed yet (under BulkEndpoint._lock)
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def start(self, function: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
        """Run `function(*args)` as a task on this loop (callable from any thread)."""
        self._loop.call_soon_threadsafe(self._create_task, function, args)

    def call_later(self, seconds: float, function: Callable[[], None]) -> None:
        """Call `function()` on this loop in `seconds` (callable from any thread; nothing once
        the loop is closed)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, function)

    def stop(self) -> None:
        """Cancel every task, let each finish (closing its connection), stop and close the loop
        (once: a second call does nothing)."""
        if self._loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError, TimeoutError):  # closed already; or a task hangs
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=5)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def _create_task(self, function: Callable[..., Coroutine[Any, Any, None]], args: tuple[object, ...]) -> None:
        task = self._loop.create_task(function(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, view: memoryview) -> None:
    received = 0
    while received < view.nbytes:
        n = await loop.sock_recv_into(conn, view[received:])
        if not n:
            raise EOFError("connection closed before a ticket arrived")
        received += n


async def _receive_all(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, into: memoryview, arrived: Callable[[int], None]
) -> None:
    """Fill `into` from the connection, reading while bytes are there and waiting for more when
    not, and tell `arrived` of every HASH_STRETCH more; EOFError when the sender closes early,
    TimeoutError when it sends nothing for SEND_STALL_SECONDS."""
    readable = asyncio.Event()
    loop.add_reader(conn, readable.set)
    try:
        received = told = 0
        while received < into.nbytes:
            readable.clear()
            try:
                n = conn.recv_into(into[received:])
            except (BlockingIOError, InterruptedError):
                async with asyncio.timeout(SEND_STALL_SECONDS):
                    await readable.wait()
                continue
            if not n:
                raise EOFError(f"the sender closed the connection after {received} of {into.nbytes} bytes")
            received += n
            if received - told >= HASH_STRETCH or received == into.nbytes:
                arrived(received)
                if received // YIELD_STRETCH != told // YIELD_STRETCH:
                    await asyncio.sleep(0)  # a long upload lets this loop's other connections in
                told = received
    finally:
        loop.remove_reader(conn)


async def _send_as_landed(
    loop: asyncio.AbstractEventLoop,
    conn: socket.socket,
    data: memoryview,
    landed: Callable[[int, float], Awaitable[int]],
) -> None:
    """Send `data` as its bytes land, each part once `landed` says it is in place."""
    sent = 0
    while sent < data.nbytes:
        end = await landed(sent, SEND_STALL_SECONDS)
        await _send_all(loop, conn, data[sent:end])
        sent = end


async def _send_all(loop: asyncio.AbstractEventLoop, conn: socket.socket, data: memoryview) -> None:
    """Send `data` (no copy: the kernel reads the memoryview), waiting for room in the socket
    buffer whenever it is full; TimeoutError when the reader takes nothing for
    SEND_STALL_SECONDS."""
    writable = asyncio.Event()
    loop.add_writer(conn, writable.set)  # for the whole transfer: no epoll_ctl per wait
    try:
        sent = 0
        while sent < data.nbytes:
            writable.clear()
            try:
                n = conn.send(data[sent:])
            except (BlockingIOError, InterruptedError):
                n = 0
            sent += n
            if sent < data.nbytes and n < 1 << 20:  # the buffer is (nearly) full: wait for room
                async with asyncio.timeout(SEND_STALL_SECONDS):
                    await writable.wait()
    finally:
        loop.remove_writer(conn)
