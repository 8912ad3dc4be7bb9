"""Bulk: payloads and uploads over plain TCP beside gRPC (a gRPC stream tops out near 0.6x of it).

A client sends a single-use 16-byte ticket from Negotiate, then receives the payload or sends an
upload (acknowledged with ACK). The ticket is the capability, so a peer's hold is bounded: at most
`max_connections`, a ticket in time, and a reader stalled for SEND_STALL_SECONDS is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightserver.protocol import cpus
from weightserver.v1 import weights_pb2 as pb

if TYPE_CHECKING:
    from weightserver.publish.incoming import IncomingPublish
    from weightserver.publish.receiver import IncomingModel
    from weightserver.publish.staged_uploads import StagedUploads
    from weightserver.storage.payloads import Payload
    from weightserver.storage.store import Version

log = logging.getLogger(__name__)

TICKET_BYTES = 16
ACK = b"\x01"  # an upload's bytes are all in
HASH_STRETCH = 1 << 20  # an upload's bytes are handed on (hashed) once this many more are in
YIELD_STRETCH = 16 << 20  # a long upload lets its loop's other connections in this often
TICKET_TTL_SECONDS = 60.0
SOCKET_BUFFER = 8 << 20  # a fresh connection's window otherwise starts small
DEFAULT_MAX_CONNECTIONS = 256
FIRST_TICKET_SECONDS = 10.0
IDLE_CONNECTION_SECONDS = 120.0
SEND_STALL_SECONDS = 30.0
ACCEPT_RETRY_SECONDS = (0.05, 1.0)  # after a failed accept (out of descriptors): first, longest pause
REFUSED_LOG_SECONDS = 60.0  # at most one warning this often about connections over the cap
LOOPS = min(8, cpus.usable_cpus())  # a send's copy into the kernel costs its thread's CPU


@dataclass
class _Pending:
    parts: tuple[memoryview, ...]  # sent one after the other; an upload is received into one
    label: str
    expires: float = 0.0
    arrived: Callable[[int], None] | None = None  # an upload: the first n bytes are in
    done: Callable[[BaseException | None], None] | None = None  # an upload's end
    landed: Callable[[int, float], Awaitable[int]] | None = None


class BulkEndpoint:
    """Serves tickets on `host:port` (port 0 picks a free one) from LOOPS threads."""

    def __init__(self, host: str, port: int = 0, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
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
        self._refused = 0  # connections reset at once (`max_connections` were open) since the last warning
        self._refused_logged = -REFUSED_LOG_SECONDS  # when that warning was
        self._loops = [_Loop(f"weightserver-bulk-{i}") for i in range(LOOPS)]
        self._loops[0].start(self._accept_loop)

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(loop.connections for loop in self._loops)

    @property
    def tickets(self) -> int:
        """Tickets issued and not yet used or expired."""
        with self._lock:
            return len(self._tickets)

    def issue(self, data: bytes | bytearray | memoryview | tuple[memoryview, ...], label: str, **pending: Any) -> bytes:
        """A ticket that sends `data` (a buffer, or consecutive parts) once (with `landed`: as it lands);
        with `arrived` and `done`, one that receives an upload into `data` (`arrived` may raise to stop it)."""
        ticket, expires = secrets.token_bytes(TICKET_BYTES), time.monotonic() + TICKET_TTL_SECONDS
        with self._lock:
            parts = data if isinstance(data, tuple) else (memoryview(data).cast("B"),)
            self._tickets[ticket] = _Pending(parts, label, expires, **pending)
        self._loops[0].call_later(TICKET_TTL_SECONDS + 0.1, self._drop_expired)
        return ticket

    def _drop_expired(self) -> None:
        """An upload's ticket goes unheard: its staged upload expires on its own."""
        now = time.monotonic()
        with self._lock:
            self._tickets = {ticket: p for ticket, p in self._tickets.items() if p.expires >= now}

    def close(self) -> None:
        """Stop accepting and drop every connection (a transfer in flight is cut)."""
        for loop in self._loops:
            loop.stop()
        self._socket.close()

    async def _accept_loop(self) -> None:
        loop, pause = asyncio.get_running_loop(), ACCEPT_RETRY_SECONDS[0]
        while True:
            try:
                conn, peer = await loop.sock_accept(self._socket)
            except Exception as exc:  # EMFILE, ENFILE, ENOBUFS: keep serving, warn once per run
                level = logging.WARNING if pause == ACCEPT_RETRY_SECONDS[0] else logging.DEBUG
                log.log(level, "bulk: accept failed (%s); retrying", exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, ACCEPT_RETRY_SECONDS[1])
                continue
            pause = ACCEPT_RETRY_SECONDS[0]
            with self._lock:  # the least busy loop takes it
                target = min(self._loops, key=lambda candidate: candidate.connections)
                open_now = sum(candidate.connections for candidate in self._loops)
                full = open_now >= self.max_connections
                target.connections += not full
            if full:  # reset, not closed: the client hears at once, and this side keeps no TIME_WAIT
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                self._refused += 1
                if time.monotonic() - self._refused_logged >= REFUSED_LOG_SECONDS:
                    log.warning(
                        "bulk: %d connections open, the most --bulk-max-connections allows; reset %d new one(s) "
                        "since the last warning (the latest from %s): those clients fetch over the gRPC stream",
                        *(open_now, self._refused, peer),
                    )
                    self._refused, self._refused_logged = 0, time.monotonic()
                continue
            try:
                target.start(self._serve_connection, conn, peer, target)
            except Exception:  # the loop is closing, or out of memory: drop this one, keep accepting
                self._closed(conn, target)
                log.exception("bulk: could not serve a connection from %s", peer)

    def _closed(self, conn: socket.socket, loop: _Loop) -> None:
        conn.close()
        with self._lock:
            loop.connections -= 1

    async def _serve_connection(self, conn: socket.socket, peer: object, owner: _Loop) -> None:
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wait, ticket = FIRST_TICKET_SECONDS, bytearray(TICKET_BYTES)
            while True:
                pending = None  # not held while idle: its version may be evicted meanwhile
                try:
                    async with asyncio.timeout(wait):  # the whole ticket: `_receive`'s bound is per byte
                        await _receive(conn, memoryview(ticket), None, wait)
                except (OSError, EOFError, TimeoutError):
                    return  # the client closed its connection, or sent no ticket in time
                with self._lock:
                    pending = self._tickets.pop(bytes(ticket), None)
                if pending is None or pending.expires < time.monotonic():
                    log.warning("bulk: unknown or expired ticket from %s", peer)
                    return
                if not await self._transfer(conn, peer, pending):
                    return  # where a failed transfer left the stream is unknown
                wait = IDLE_CONNECTION_SECONDS
        finally:
            self._closed(conn, owner)

    async def _transfer(self, conn: socket.socket, peer: object, pending: _Pending) -> bool:
        started, done = time.perf_counter(), pending.done
        try:
            if done is not None:
                await _receive(conn, pending.parts[0], pending.arrived, SEND_STALL_SECONDS)
            else:
                for part in pending.parts:
                    await _send(conn, part, pending.landed)
        except BaseException as exc:  # a reset, a stall, no safetensors file, a failed publish; cancelled
            if done is not None:
                done(exc)
            if not isinstance(exc, Exception):
                raise
            why = f"stalled: nothing moved for {SEND_STALL_SECONDS:g}s" if isinstance(exc, TimeoutError) else exc
            log.warning("bulk: transfer of %s with %s failed: %s", pending.label, peer, why)
            return False
        if done is not None:
            done(None)  # before the ACK: the publisher's next call may name the upload at once
            try:
                await asyncio.get_running_loop().sock_sendall(conn, ACK)
            except OSError as exc:
                log.warning("bulk: could not acknowledge the upload of %s to %s: %s", pending.label, peer, exc)
                return False
        ms, moved = (time.perf_counter() - started) * 1e3, sum(p.nbytes for p in pending.parts)
        log.debug("bulk: moved %s (%d bytes) with %s in %.1f ms", pending.label, moved, peer, ms)
        return True


class _Loop:
    """An asyncio event loop in its own thread (a send's copy into the kernel costs its CPU)."""

    def __init__(self, name: str) -> None:
        self.connections = 0  # handed to this loop and not closed yet (under BulkEndpoint._lock)
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def start(self, function: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
        def create_task() -> None:
            task = self._loop.create_task(function(*args))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(create_task)

    def call_later(self, seconds: float, function: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, function)

    def stop(self) -> None:
        if self._loop.is_closed():
            return

        async def cancel_all() -> None:
            for task in self._tasks:  # (a task leaves the set in a callback, after this loop)
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError, TimeoutError):  # closed already; or a task hangs
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=5)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


async def _receive(conn: socket.socket, into: memoryview, arrived: Callable[[int], None] | None, stall: float) -> None:
    """Fill `into`, telling `arrived` of every HASH_STRETCH more; EOFError or TimeoutError."""
    loop, readable = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(conn, readable.set)
    try:
        received = told = 0
        while received < into.nbytes:
            readable.clear()
            try:
                n = conn.recv_into(into[received:])
            except (BlockingIOError, InterruptedError):
                async with asyncio.timeout(stall):
                    await readable.wait()
                continue
            if not n:
                raise EOFError(f"the sender closed the connection after {received} of {into.nbytes} bytes")
            received += n
            if arrived is not None and (received - told >= HASH_STRETCH or received == into.nbytes):
                arrived(received)
                if received // YIELD_STRETCH != told // YIELD_STRETCH:
                    await asyncio.sleep(0)
                told = received
    finally:
        loop.remove_reader(conn)


async def _send(conn: socket.socket, data: memoryview, landed: Callable[[int, float], Awaitable[int]] | None) -> None:
    """Send `data`, each part once `landed` says it is in place; TimeoutError on a stalled reader."""
    loop, writable = asyncio.get_running_loop(), asyncio.Event()
    loop.add_writer(conn, writable.set)  # for the whole transfer: no epoll_ctl per wait
    try:
        sent = 0
        while sent < data.nbytes:
            end = await landed(sent, SEND_STALL_SECONDS) if landed is not None else data.nbytes
            while sent < end:
                writable.clear()
                try:
                    n = conn.send(data[sent:end])
                except (BlockingIOError, InterruptedError):
                    n = 0
                sent += n
                if sent < end and n < 1 << 20:  # the buffer is (nearly) full: wait for room
                    async with asyncio.timeout(SEND_STALL_SECONDS):
                        await writable.wait()
    finally:
        loop.remove_writer(conn)


class BulkTransport:
    """Fetches and uploads over the bulk endpoint; uploads land in a shared-memory file if there is room."""

    name, kind = "bulk", pb.TRANSPORT_BULK

    def __init__(self, endpoint: BulkEndpoint, uploads: StagedUploads) -> None:
        self.endpoint, self.uploads = endpoint, uploads

    async def offer(self, record: Version, payload: Payload, description: pb.Payload) -> bool:
        return self._describe(description, payload.parts, f"{record.model} v{record.version}")

    def offer_incoming(self, incoming: IncomingPublish, description: pb.Payload) -> bool:
        label = f"{incoming.model!r} (incoming)"
        return self._describe(description, incoming.buffer, label, landed=incoming.landed_beyond)

    def stage(self, header: pb.PublishHeader, owner: bytes | None, description: pb.Payload) -> IncomingModel | None:
        try:
            upload = self.uploads.create(header.model, header.total_bytes, "bulk", owner=owner)
        except OSError:
            return None
        self._describe(description, upload.buffer, repr(header.model), arrived=upload.arrived, done=upload.transferred)
        return upload

    def _describe(self, description: pb.Payload, *data_label: Any, **pending: Any) -> bool:
        """A ticket (`BulkEndpoint.issue`'s arguments), in `description` with the port to hand it to."""
        description.bulk.port, description.bulk.ticket = self.endpoint.port, self.endpoint.issue(*data_label, **pending)
        return True
