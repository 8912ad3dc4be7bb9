"""The gRPC streams, Publish and Fetch: always there, under TLS too, all that clients in other languages need.
Chunks travel pre-framed (protocol.framing)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import grpc

from weightclient.core.retry import Deadline
from weightclient.transports.base import Answer, Into, Offer, OutgoingFile, Progress, Transport, is_sink, receive_buffer
from weightserver.protocol import framing
from weightserver.protocol.errors import DeadlineExceeded, IntegrityError
from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb


class StreamTransport(Transport):
    name: ClassVar[str] = "stream"
    kind: ClassVar[int] = pb.TRANSPORT_STREAM

    def __init__(self, channel: grpc.Channel, metadata: Any, chunk_bytes: int) -> None:
        self.chunk_bytes, self._metadata = chunk_bytes, metadata
        self._fetch = channel.unary_stream(
            "/weightserver.v1.WeightService/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=framing.deserialize_fetch_response,
        )
        self._publish = channel.stream_unary(
            "/weightserver.v1.WeightService/Publish",
            request_serializer=framing.serialize,
            response_deserializer=pb.PublishResponse.FromString,
        )

    def send(
        self, files: Sequence[OutgoingFile], *, deadline: Deadline, progress: Progress | None
    ) -> pb.PublishResponse:
        """Publish `files` as one version (a Publish call, which carries their bytes)."""
        messages = self._publish_messages(files, progress)
        return self._publish(messages, timeout=deadline.remaining(), metadata=self._metadata)

    def _publish_messages(self, files: Sequence[OutgoingFile], progress: Progress | None) -> Iterator[Any]:
        """Each header, then its parts as chunks (or the upload that moved them), then the commit; `progress` hears
        of each chunk once gRPC took it."""
        total = sum(f.header.total_bytes for f in files)
        sent = 0
        for file in files:
            yield pb.PublishRequest(header=file.header)
            if file.uploaded:
                # (the file's xxh3 is in the header, which now follows the upload)
                done = pb.PublishUploaded(upload=file.uploaded, tensor_xxh3=file.tensor_xxh3 or {})
                yield pb.PublishRequest(uploaded=done)
                sent += file.header.total_bytes
                continue
            end = sent + file.header.total_bytes
            for message in framing.chunk_messages(file.parts, self.chunk_bytes, framing.PUBLISH_CHUNK_TAG):
                yield message
                sent = min(sent + self.chunk_bytes, end)
                if progress is not None:
                    progress(sent, total)
        yield pb.PublishRequest(commit=pb.PublishCommit())

    def offer(
        self, request: pb.FetchRequest, answer: Answer, deadline: Deadline, info: VersionInfo, stall: float = 0.0
    ) -> Offer | None:
        """Start a Fetch and read its head: the header (then a payload for a delta or cast), or for incoming bytes the
        payload only, under `info`; None when up to date. With `stall`, see Offer: the deadline bounds the head only."""
        stream: Any = self._fetch(request, timeout=None if stall else deadline.remaining(), metadata=self._metadata)
        if stall:
            stream = _StallGuard(stream, stall, head_by=deadline)
        try:
            first = next(stream, None)
            kind = first.WhichOneof("kind") if isinstance(first, pb.FetchResponse) else None
            if kind == "up_to_date" and not request.incoming:
                for _ in stream:  # read to its end: cancelling it races with the server's OK and logs an error
                    raise IntegrityError(f"model {request.model!r}: the server sent more than the fetch expects")
                return None
            if kind == "payload" and request.incoming:
                payload = first.payload
            elif kind != "header" or request.incoming:
                raise IntegrityError(f"model {request.model!r}: the fetch stream did not start with its head")
            else:
                info = VersionInfo.from_proto(first.header)
                payload = pb.Payload(byte_size=info.byte_size, xxh3=info.xxh3)
                if request.base_version or request.dtype or request.HasField("select"):
                    second = next(stream, None)
                    if not isinstance(second, pb.FetchResponse) or not second.HasField("payload"):
                        raise IntegrityError(
                            f"model {request.model!r}: expected a payload description after the header"
                        )
                    payload = second.payload
        except BaseException:
            stream.cancel()
            raise
        if stall:
            stream.head_by = None  # its head read: from here the guard ends it only on a stall
        return Offer(info, payload, chunks=stream, deadline=deadline)

    def receive(self, offer: Offer, *, into: Into, progress: Progress | None) -> memoryview:
        assert offer.chunks is not None, "a stream offer comes from StreamTransport.offer"
        target = into if is_sink(into) else receive_buffer(offer.payload.byte_size, into)
        try:
            framing.receive_chunks(offer.chunks, target, progress)
        except ValueError as exc:
            raise IntegrityError(
                f"model {offer.label}: the streamed payload does not fit its description: {exc}"
            ) from exc
        finally:
            offer.chunks.cancel()
        return target if isinstance(target, memoryview) else memoryview(b"")


class _StallGuard:
    """A Fetch call cancelled once no message came for `seconds`, a deadline on each wait rather than the whole call
    (see Offer.stall); and, while `head_by` is set (until the caller has the stream's head), at that deadline."""

    def __init__(self, call: Any, seconds: float, head_by: Deadline | None = None) -> None:
        self._call, self._seconds, self.head_by = call, seconds, head_by
        self._stalled: str | None = None  # why it was cancelled
        self._last, self._ended = time.monotonic(), threading.Event()
        threading.Thread(target=self._watch, name="weightclient-stall-guard", daemon=True).start()

    def __iter__(self) -> _StallGuard:
        return self

    def __next__(self) -> Any:
        try:
            message = next(self._call)
        except grpc.RpcError:
            if self._stalled:
                raise DeadlineExceeded(self._stalled) from None
            raise
        except StopIteration:
            self._ended.set()
            raise
        self._last = time.monotonic()
        return message

    def cancel(self) -> None:
        self._ended.set()
        self._call.cancel()

    def _watch(self) -> None:
        while not self._ended.wait(min(self._seconds, 1.0) / 4):
            head_by = self.head_by
            if head_by is not None and head_by.expired():
                self._stalled = "the stream's head did not come within the call's timeout"
            elif time.monotonic() - self._last > self._seconds:
                self._stalled = f"the stream sent nothing for {self._seconds:g}s"
            else:
                continue
            self._call.cancel()
            return
