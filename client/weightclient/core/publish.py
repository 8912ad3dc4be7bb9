"""Publishing: each model's bytes over the transport Negotiate picks, then one Publish call; the
next upload is set up meanwhile (`SpareUploads`: a page-table fill, about 0.3 ms per MiB)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

from weightclient.core.failover import Connection, map_rpc_errors
from weightclient.core.retry import Deadline
from weightclient.transports import OutgoingFile, Transport, TransportFailed
from weightclient.transports.base import Progress
from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.errors import InvalidRequest, UploadNotFound
from weightserver.protocol.limits import version_number
from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
SPARE_NEGOTIATE_SECONDS = 10.0  # a spare upload's Negotiate, in the background
SPARE_SECONDS = 45.0  # under the server's 60 s for an upload nobody named
MAX_SPARE_BYTES = 2 << 30  # above, a spare held in the server's memory costs more (4 GiB ran 24 GiB out)


def publish_version(version: object) -> int:
    """A publish's requested `version`, refused before any call unless a version field holds it."""
    return version_number(version, "version", meaning="0: the next one; the server takes at most 2**63-1")


@dataclass(frozen=True)
class Spare:
    transport: Transport
    answer: pb.NegotiateResponse
    expires: float
    expiry: threading.Timer | None = None  # lets it go at `expires` unless it was taken or let go first

    def let_go(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
        self.transport.release(self.answer.payload)


class SpareUploads:
    """At most one upload set up ahead per model and transport."""

    def __init__(self, negotiate: Callable[..., pb.NegotiateResponse]) -> None:
        self._negotiate = negotiate
        self._lock = threading.Lock()
        self._spares: dict[tuple[str, int], Spare] = {}
        self._preparing: dict[tuple[str, int, int], Future[None]] = {}  # (model, kind, size): being set up
        self._closed = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightclient-spare-uploads")

    def take(self, model: str, size: int, order: Sequence[Transport], deadline: Deadline) -> Spare | None:
        """The spare for the first transport of `order` that has one; one still being set up is waited
        for, within `deadline` (else this publish would stage a second model-sized upload)."""
        with self._lock:
            preparing = [self._preparing.get((model, t.kind, size)) for t in order]
        for future in (f for f in preparing if f is not None):  # (not `wait`: a set-up that close() took off
            with contextlib.suppress(CancelledError, TimeoutError):  # the queue never tells it, and it waits on)
                future.exception(timeout=deadline.remaining())
        now, stale, found = time.monotonic(), [], None
        with self._lock:
            for transport in order:
                spare = self._spares.pop((model, transport.kind), None)
                if spare is None:
                    continue
                if spare.expires > now and spare.answer.payload.byte_size == size:
                    found = spare
                    break
                stale.append(spare)
        for spare in stale:
            spare.let_go()
        if found is not None and found.expiry is not None:
            found.expiry.cancel()
        return found

    def refill(self, model: str, size: int, transport: Transport) -> None:
        if size > MAX_SPARE_BYTES:
            return
        try:
            future = self._thread.submit(self._prepare, model, size, transport)
        except RuntimeError:  # closed meanwhile
            return
        with self._lock:  # (those done go: `take` would not wait for them)
            self._preparing = {key: f for key, f in self._preparing.items() if not f.done()}
            self._preparing[(model, transport.kind, size)] = future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares, self._spares = list(self._spares.values()), {}
        self._thread.shutdown(wait=False, cancel_futures=True)
        for spare in spares:
            spare.let_go()

    def _prepare(self, model: str, size: int, transport: Transport) -> None:
        header = pb.PublishHeader(model=model, total_bytes=size)
        try:
            answer = self._negotiate(SPARE_NEGOTIATE_SECONDS, [transport.kind], publish=header)
            if answer.transport != transport.kind:
                return
            transport.prepare(answer.payload)
        except Exception as exc:  # a spare is a bonus: the next publish negotiates as usual
            log.debug("no spare upload of %r over %s: %s", model, transport.name, exc)
            return
        key, expires = (model, transport.kind), time.monotonic() + SPARE_SECONDS
        expiry = threading.Timer(SPARE_SECONDS, self._expire, (key, expires))
        expiry.daemon = True
        spare = Spare(transport, answer, expires, expiry)
        with self._lock:
            unused = spare if self._closed else self._spares.get(key)
            if not self._closed:
                self._spares[key] = spare
                expiry.start()
        if unused is not None:
            unused.let_go()

    def _expire(self, key: tuple[str, int], expires: float) -> None:
        """Let the spare at `key` go if it is still the one that expires at `expires` (no publish took it)."""
        with self._lock:
            spare = self._spares.get(key)
            if spare is None or spare.expires != expires:
                return
            del self._spares[key]
        log.debug("letting go of the spare upload of %r, unused for %.0fs", key[0], SPARE_SECONDS)
        spare.let_go()


class Publishing(Connection):
    @functools.cached_property
    def _spares(self) -> SpareUploads:
        return SpareUploads(self._negotiate)

    def publish_bytes(
        self, model: str, parts: Buffer | Sequence[Buffer], *, sha256: str | None = None, **options
    ) -> VersionInfo:
        """Publish one safetensors file, whole or as consecutive parts (not joined)."""
        return self.publish_group_bytes({model: parts}, sha256s={model: sha256}, **options)[0]

    def publish_group_bytes(
        self,
        files: Mapping[str, Buffer | Sequence[Buffer]],
        *,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        sha256s: Mapping[str, str | None] | None = None,
        timeout: float | None = None,
        progress: Progress | None = None,
        publish_id: str | None = None,
        transport: str = "auto",
    ) -> list[VersionInfo]:
        """Several models' files under ONE version number (0: latest + 1). The server commits a
        `publish_id` (default: a new one; "" sends none) once: a retry gets the first's version."""
        if not files:
            raise InvalidRequest("publish needs at least one model")
        version = publish_version(version)
        publish_id = uuid.uuid4().hex if publish_id is None else publish_id
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        outgoing = []
        for model, parts in files.items():
            views = [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, Buffer) else parts)]
            size, sha256 = sum(v.nbytes for v in views), (sha256s or {}).get(model) or ""
            header = pb.PublishHeader(model=model, metadata=meta, total_bytes=size, sha256=sha256, pin=pin)
            outgoing.append(OutgoingFile(header, views))
        first = outgoing[0].header  # the version and the publish id go with the first model
        first.version, first.publish_id = version, publish_id
        deadline = Deadline.after(timeout)
        try:
            return self._publish_once(outgoing, transport, deadline, progress, spares=True)
        except UploadNotFound:  # the server forgot an upload set up ahead (it restarted)
            log.info("the server forgot an upload set up ahead; publishing again without it")
            return self._publish_once(outgoing, transport, deadline, progress, spares=False)

    def _publish_once(
        self, files: list[OutgoingFile], choice: str, deadline: Deadline, progress: Progress | None, spares: bool
    ) -> list[VersionInfo]:
        """One attempt: each model's bytes moved (`_upload`), then one Publish call that names or carries them."""
        order, grand_total, done = self.transports.order(choice), sum(f.header.total_bytes for f in files), 0
        outgoing: list[OutgoingFile] = []
        with map_rpc_errors(self.address):
            for file in files:
                counted = None if progress is None else lambda moved, _, at=done: progress(at + moved, grand_total)
                outgoing.append(self._upload(file, order, deadline, counted, spares))
                done += file.header.total_bytes
            reply = self.transports.stream.send(outgoing, deadline=deadline, progress=progress)
        # Set up each fast upload's successor now, not before: on few cores it slows the commit.
        for file in outgoing:
            if file.transport is not None:
                self._spares.refill(file.header.model, file.header.total_bytes, file.transport)
        return [VersionInfo.from_proto(v) for v in reply.versions] or [VersionInfo.from_proto(reply.version)]

    def _upload(
        self, file: OutgoingFile, order: list[Transport], deadline: Deadline, progress: Progress | None, spares: bool
    ) -> OutgoingFile:
        """One model's bytes over the transport the server picks (a spare first); over the stream,
        none is named and the Publish call carries them (their xxh3 in the header)."""
        header, views, size = file.header, file.parts, file.header.total_bytes
        spare = self._spares.take(header.model, size, order, deadline) if size else None
        if spare is not None and not spares:
            spare.transport.release(spare.answer.payload)
            spare = None
        while len(order) > 1 and size:
            answer = spare.answer if spare is not None else None
            if answer is None:
                answer = self._negotiate(deadline.remaining(), [t.kind for t in order], publish=header)
            transport, spare = self.transports.by_kind[answer.transport], None
            if transport is self.transports.stream:
                break
            try:
                moved = transport.upload(answer.payload, views, deadline=deadline, progress=progress)
            except TransportFailed as exc:
                self.transports.failed(transport, exc)
                order = [t for t in order if t is not transport]
                continue
            header.xxh3 = moved.xxh3
            self.transports.worked(transport)
            return OutgoingFile(header, views, answer.upload, transport, moved.tensor_xxh3)
        header.xxh3 = xxh3_hex(*views)
        return file

    def close(self) -> None:
        if "_spares" in self.__dict__:
            self._spares.close()
        super().close()
