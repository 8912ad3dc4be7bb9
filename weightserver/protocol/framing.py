"""Pre-serialized chunk messages: the bytes of `FetchResponse{chunk}` and `PublishRequest{chunk}`.

Weights move as thousands of 1 MiB chunk messages. Building each through the generated
classes copies its bytes twice (into the message, then into its serialization); framing them
by hand copies once when sending and not at all when receiving. Both messages are a oneof
whose `chunk` is a length-delimited field, so one framing serves both; the tag is read from
the generated descriptors, never written down, and tests/unit/test_framing.py round-trips it
through the generated classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from google.protobuf.message import Message

from weightserver.v1 import weights_pb2 as pb

_LENGTH_DELIMITED = 2


def _chunk_tag(message: type[Message]) -> bytes:
    number = message.DESCRIPTOR.fields_by_name["chunk"].number
    return _varint(number << 3 | _LENGTH_DELIMITED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


FETCH_CHUNK_TAG = _chunk_tag(pb.FetchResponse)
PUBLISH_CHUNK_TAG = _chunk_tag(pb.PublishRequest)


def chunk_messages(
    data: bytes | bytearray | memoryview, chunk_bytes: int, tag: bytes = FETCH_CHUNK_TAG
) -> Iterator[bytes]:
    """Serialized `{chunk}` messages over `data`, `chunk_bytes` at a time, one copy each."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, chunk_bytes):
        part = view[start : start + chunk_bytes]
        yield b"".join((tag, _varint(part.nbytes), part))


def chunk_message(parts: list[memoryview], tag: bytes = PUBLISH_CHUNK_TAG) -> bytes:
    """One serialized `{chunk}` message carrying `parts` back to back (one copy)."""
    return b"".join((tag, _varint(sum(p.nbytes for p in parts)), *parts))


def chunk_of(raw: bytes, tag: bytes = FETCH_CHUNK_TAG) -> memoryview | None:
    """The payload of a serialized `{chunk}` message as a view of `raw` (no copy), or None
    when `raw` is any other message."""
    if not raw.startswith(tag):
        return None
    length = shift = 0
    position = len(tag)
    while position < len(raw):
        byte = raw[position]
        position += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return memoryview(raw)[position:] if position + length == len(raw) else None
        shift += 7
    return None


def serialize(message: Message | bytes) -> bytes:
    """A serializer for streams that mix generated messages and pre-serialized chunks."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def deserialize_fetch_response(raw: bytes) -> pb.FetchResponse | memoryview:
    """Fetch's response deserializer: chunks become views of their bytes, others parse."""
    chunk = chunk_of(raw)
    return chunk if chunk is not None else pb.FetchResponse.FromString(raw)


class Sink(Protocol):
    """Where received bytes go: `target(n)` is a writable view of at most n bytes for the next
    ones, `advance(n)` says n of them were written, `done` once all are in. ValueError when
    bytes do not fit."""

    @property
    def done(self) -> bool: ...

    def target(self, most: int) -> memoryview: ...

    def advance(self, n: int) -> None: ...


class BufferSink:
    """A sink that fills one buffer front to back."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.received = buffer, 0

    @property
    def done(self) -> bool:
        return self.received == self.buffer.nbytes

    def target(self, most: int) -> memoryview:
        return self.buffer[self.received : self.received + most]

    def advance(self, n: int) -> None:
        if n > self.buffer.nbytes - self.received:
            raise ValueError(f"more than the announced {self.buffer.nbytes} bytes")
        self.received += n


def receive_chunks(chunks: Iterable[memoryview], sink: Sink, progress: Callable[[int], None] | None = None) -> None:
    """The one chunk-receive loop: every chunk into `sink`, in order; `progress(received)` after
    each. ValueError when the chunks hold more or fewer bytes than the sink takes."""
    received = 0
    for chunk in chunks:
        received += chunk.nbytes
        while chunk.nbytes:
            if sink.done:
                raise ValueError("more bytes than announced")
            target = sink.target(chunk.nbytes)
            target[:] = chunk[: target.nbytes]
            sink.advance(target.nbytes)
            chunk = chunk[target.nbytes :]
        if progress is not None:
            progress(received)
    if not sink.done:
        raise ValueError("the stream was cut short")
