"""Publishing safetensors files: each model's bytes over the transport Negotiate picks, then
one Publish call that commits them together."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence

import xxhash

from weightclient.core.failover import Connection, map_rpc_errors
from weightclient.core.retry import Deadline
from weightclient.core.spare_uploads import SpareUploads
from weightclient.transports import OutgoingFile, Transport, TransportFailed
from weightclient.transports.base import Progress
from weightclient.transports.stream import OpenPublish
from weightserver.protocol.errors import InvalidRequest, UploadNotFound
from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
SPARE_NEGOTIATE_SECONDS = 10.0  # a spare upload's Negotiate, in the background
ANNOUNCE_MIN_BYTES = 4 << 20
ANNOUNCE_PARTS = 16


class _StartOver(Exception):
    """Writing in place failed after the Publish call sent its header: publish again without."""


class Publishing(Connection):
    """The publish half of `WeightServiceClient`."""

    @functools.cached_property
    def _spares(self) -> SpareUploads:
        return SpareUploads(
            lambda request: self._stub.Negotiate(request, timeout=SPARE_NEGOTIATE_SECONDS, metadata=self._metadata)
        )

    def publish_bytes(
        self,
        model: str,
        parts: Buffer | Sequence[Buffer],
        *,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        sha256: str | None = None,
        timeout: float | None = None,
        progress: Progress | None = None,
        publish_id: str | None = None,
        transport: str = "auto",
    ) -> VersionInfo:
        """Publish one safetensors file, whole or as consecutive parts (sent without joining
        them); return the version. `version` 0: the server assigns latest + 1. The other
        arguments: see `publish_group_bytes`."""
        options = dict(version=version, metadata=metadata, pin=pin, timeout=timeout, progress=progress)
        return self.publish_group_bytes(
            {model: parts}, sha256s={model: sha256}, publish_id=publish_id, transport=transport, **options
        )[0]

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
        """Publish several models' files under ONE version number, committed together; each
        model's version, in `files` order. `progress(sent, total)` counts all models.

        `publish_id` (default: a new one; "" sends none): the server commits an id once, so a
        retry with the same id after a lost reply gets the first attempt's version.
        `transport`: "auto" (shared memory on the server's host, else bulk TCP, else the
        stream), "shm", "bulk" or "stream", each falling back to the next.

        Each header declares the file's xxh3-128; a sha256 in `sha256s` is declared too. The
        server computes the sha256 itself when none was given, so the reply's may be ""."""
        if not files:
            raise InvalidRequest("publish needs at least one model")
        publish_id = uuid.uuid4().hex if publish_id is None else publish_id
        options = dict(version=version, metadata=metadata, pin=pin, sha256s=sha256s, progress=progress)
        deadline = Deadline.after(timeout)
        spares, in_place = True, True
        while True:  # at most three attempts: each clears one of the two flags
            try:
                return self._publish_group(files, publish_id, transport, deadline, spares, in_place, **options)
            except UploadNotFound:
                if not spares:  # else the server forgot an upload set up ahead (it restarted)
                    raise
                log.info("the server forgot an upload set up ahead; publishing again without it")
                spares = False
            except _StartOver as exc:  # the cancelled call committed nothing
                log.info("writing a publish in place failed (%s); publishing again", exc.__cause__)
                in_place = False

    def _publish_group(
        self,
        files: Mapping[str, Buffer | Sequence[Buffer]],
        publish_id: str,
        transport: str,
        deadline: Deadline,
        spares: bool,
        in_place: bool,
        *,
        version: int,
        metadata: Mapping[str, str] | None,
        pin: bool,
        sha256s: Mapping[str, str | None] | None,
        progress: Progress | None,
    ) -> list[VersionInfo]:
        """One attempt. A model written in place (shared memory), when `in_place`, opens the
        Publish call before its bytes are written, so the server verifies them meanwhile."""
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        order = self.transports.order(transport)
        stream = self.transports.stream
        models = {
            model: [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, Buffer) else parts)]
            for model, parts in files.items()
        }
        grand_total = sum(v.nbytes for views in models.values() for v in views)
        total = 0
        outgoing: list[OutgoingFile] = []
        call: OpenPublish | None = None  # opened early, for a model written in place

        def opened() -> OpenPublish:
            nonlocal call
            if call is None:
                call = stream.open_publish(deadline=deadline)
                for file in outgoing:
                    call.send_file(file)
            return call

        with map_rpc_errors(self.address):
            try:
                for i, (model, views) in enumerate(models.items()):
                    header = pb.PublishHeader(
                        model=model,
                        version=version if i == 0 else 0,
                        metadata=meta,
                        total_bytes=sum(v.nbytes for v in views),
                        sha256=(sha256s or {}).get(model) or "",
                        pin=pin,
                        publish_id=publish_id if i == 0 else "",
                    )
                    counted = None if progress is None else _shifted(progress, total, grand_total)
                    uploaded, carrier = self._upload(
                        header, views, order, deadline, counted, spares, opened if in_place else None
                    )
                    if not uploaded:
                        header.xxh3 = _xxh3(views)
                    file = OutgoingFile(header, views, uploaded, carrier)
                    outgoing.append(file)
                    written_in_place = in_place and carrier is not None and carrier.written_in_place
                    if call is not None and not written_in_place:  # (that one sent its own messages)
                        call.send_file(file)
                    total += header.total_bytes
                reply = stream.send(outgoing, deadline=deadline, progress=progress) if call is None else call.commit()
            except BaseException:
                if call is not None:
                    call.cancel()
                raise
        # Committed: set up each fast upload's successor while the trainer trains (not before:
        # on few cores it would slow this commit down).
        for file in outgoing:
            if file.transport is not None:
                self._spares.refill(file.header.model, file.header.total_bytes, file.transport)
        return [VersionInfo.from_proto(v) for v in reply.versions] or [VersionInfo.from_proto(reply.version)]

    def _upload(
        self,
        header: pb.PublishHeader,
        views: Sequence[memoryview],
        order: list[Transport],
        deadline: Deadline,
        progress: Progress | None,
        spares: bool,
        opened: Callable[[], OpenPublish] | None,
    ) -> tuple[str, Transport | None]:
        """Move one model's bytes over the transport the server picks from `order` (an upload
        set up ahead first), setting the header's xxh3: the upload's id and its transport, or
        ("", None) for the stream, which carries them in the Publish call. A transport that
        writes in place, given `opened`, sends the model's messages itself. A failed upload is
        left to expire on the server."""
        model, size = header.model, header.total_bytes
        spare = self._spares.take(model, size, order) if size else None
        if spare is not None and not spares:
            spare.transport.release(spare.answer.payload)
            spare = None
        while len(order) > 1 and size:
            answer = spare.answer if spare is not None else None
            if answer is None:
                negotiate = pb.NegotiateRequest(
                    direction=pb.DIRECTION_PUBLISH, accept=[t.kind for t in order], publish=header
                )
                answer = self._stub.Negotiate(negotiate, timeout=deadline.remaining(), metadata=self._metadata)
            transport, spare = self.transports.by_kind[answer.transport], None
            if transport is self.transports.stream:
                break
            if transport.written_in_place and opened is not None:
                self._write_in_place(opened(), header, answer, transport, views, deadline, progress)
                self.transports.worked(transport)
                return answer.upload, transport
            try:
                header.xxh3 = transport.upload(answer.payload, views, deadline=deadline, progress=progress)
            except TransportFailed as exc:
                self.transports.failed(transport, exc)
                order = [t for t in order if t is not transport]
                continue
            self.transports.worked(transport)
            return answer.upload, transport
        return "", None

    def _write_in_place(
        self,
        call: OpenPublish,
        header: pb.PublishHeader,
        answer: pb.NegotiateResponse,
        transport: Transport,
        views: Sequence[memoryview],
        deadline: Deadline,
        progress: Progress | None,
    ) -> None:
        """Send the header, write the bytes into the upload telling the server how far they are
        every `_announce_step` bytes (it hashes them meanwhile), then name the upload and its
        xxh3. _StartOver when the transport fails: the call is spoilt (its header is sent)."""
        call.send(pb.PublishRequest(header=header))
        step, next_at = _announce_step(header.total_bytes), 0

        def announce(done: int, total: int) -> None:
            nonlocal next_at
            if done >= next_at + step and done < total:
                call.send(pb.PublishRequest(written=pb.PublishWritten(upload=answer.upload, end=done)))
                next_at = done
            if progress is not None:
                progress(done, total)

        try:
            header.xxh3 = transport.upload(answer.payload, views, deadline=deadline, progress=announce)
        except TransportFailed as exc:
            self.transports.failed(transport, exc)
            raise _StartOver() from exc
        call.send(pb.PublishRequest(uploaded=pb.PublishUploaded(upload=answer.upload, xxh3=header.xxh3)))

    def close(self) -> None:
        if "_spares" in self.__dict__:
            self._spares.close()
        super().close()


def _announce_step(total: int) -> int:
    """Bytes written in place between two words to the server: a sixteenth of the model (the
    server's last stretch to hash after the writing), at least 4 MiB (each word costs both
    sides a message; below that no gain was measured)."""
    return max(ANNOUNCE_MIN_BYTES, total // ANNOUNCE_PARTS)


def _shifted(progress: Progress, offset: int, total: int) -> Progress:
    """`progress` for one model of several: counts from `offset` up to `total`."""
    return lambda done, _: progress(offset + done, total)


def _xxh3(views: Sequence[memoryview]) -> str:
    hasher = xxhash.xxh3_128()
    for view in views:
        hasher.update(view)
    return hasher.hexdigest()
