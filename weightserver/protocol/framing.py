"""Pre-serialized `FetchResponse{chunk}` and `PublishRequest{chunk}` messages: the generated classes
copy a chunk twice; framing by hand copies once to send, never to receive."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from google.protobuf.message import Message

from weightserver.protocol.digests import BLOCK_BYTES
from weightserver.v1 import weights_pb2 as pb

_LENGTH_DELIMITED = 2
Progress = Callable[[int, int], None]  # (bytes so far, total bytes)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


FETCH_CHUNK_TAG = _varint(pb.FetchResponse.DESCRIPTOR.fields_by_name["chunk"].number << 3 | _LENGTH_DELIMITED)
PUBLISH_CHUNK_TAG = _varint(pb.PublishRequest.DESCRIPTOR.fields_by_name["chunk"].number << 3 | _LENGTH_DELIMITED)


def chunk_messages(
    data: bytes | bytearray | memoryview | Sequence[memoryview], chunk_bytes: int, tag: bytes = FETCH_CHUNK_TAG
) -> Iterator[bytes]:
    """Serialized `{chunk}` messages over `data` (one buffer, or consecutive parts sent as one),
    `chunk_bytes` at a time, one copy each."""
    parts = data if isinstance(data, (list, tuple)) else [memoryview(data).cast("B")]
    pending: list[memoryview] = []
    room = chunk_bytes
    for view in parts:
        while view.nbytes:
            take = min(room, view.nbytes)
            pending.append(view[:take])
            view, room = view[take:], room - take
            if not room:
                yield chunk_message(pending, tag)
                pending, room = [], chunk_bytes
    if pending:
        yield chunk_message(pending, tag)


def chunk_message(parts: list[memoryview], tag: bytes = PUBLISH_CHUNK_TAG) -> bytes:
    """One serialized `{chunk}` message carrying `parts` back to back (one copy)."""
    return b"".join((tag, _varint(sum(p.nbytes for p in parts)), *parts))


def chunk_of(raw: bytes, tag: bytes = FETCH_CHUNK_TAG) -> memoryview | None:
    """The payload of a serialized `{chunk}` message as a view of `raw`, or None for another message."""
    if not raw.startswith(tag):
        return None
    length = 0
    for i, byte in enumerate(memoryview(raw)[len(tag) :]):  # the payload's length, a varint
        length |= (byte & 0x7F) << 7 * i
        if not byte & 0x80:
            start = len(tag) + i + 1
            return memoryview(raw)[start:] if start + length == len(raw) else None
    return None


def serialize(message: Message | bytes) -> bytes:
    """A serializer for streams that mix generated messages and pre-serialized chunks."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def deserialize_fetch_response(raw: bytes) -> pb.FetchResponse | memoryview:
    """Fetch's response deserializer: chunks become views of their bytes, others parse."""
    chunk = chunk_of(raw)
    return chunk if chunk is not None else pb.FetchResponse.FromString(raw)


class Region(NamedTuple):
    size: int
    into: memoryview | None = None  # where the bytes land; else held in a buffer for `then`, or dropped
    then: Callable[[memoryview], None] | None = None  # given the held bytes once they are all in
    hasher: Any = None  # fed the bytes as they land (an xxhash hasher)


class Regions:
    """Scatters a file's `nbytes` received bytes into a queue of regions planned as they arrive (a region's
    `then` may push the next ones: a header, then its tensors): `target(n)` is a writable view of at most n
    bytes for the next ones, `advance(n)` says n were written; ValueError when they do not fit the layout.
    At most a block lands at a time, so it is hashed while in cache."""

    def __init__(self, nbytes: int, first: Region) -> None:
        self.nbytes = nbytes
        self._regions: deque[Region] = deque()
        self._held: memoryview | None = None  # the current region's bytes, when it holds them
        self._filled = self._received = 0
        self._push(first)

    @property
    def done(self) -> bool:
        return self._received == self.nbytes

    def target(self, most: int = BLOCK_BYTES) -> memoryview:
        if not self._regions:
            raise ValueError(f"more than the {self.nbytes} bytes laid out")
        region = self._regions[0]
        if region.into is None and region.then is not None and self._held is None:
            self._held = memoryview(bytearray(region.size))
        return self._landing(region)[: min(most, region.size - self._filled, BLOCK_BYTES)]

    def advance(self, n: int) -> None:
        region = self._regions[0]
        if self._filled + n > region.size:
            raise ValueError(f"{n} bytes do not fit the layout")
        if region.hasher is not None:
            region.hasher.update(self._landing(region)[:n])
        self._filled += n
        self._received += n
        if self._filled == region.size:
            self._regions.popleft()
            held, self._held, self._filled = self._held, None, 0
            if region.then is not None:
                region.then(held if held is not None else memoryview(b""))

    @functools.cached_property
    def _scratch(self) -> memoryview:
        return memoryview(bytearray(min(self.nbytes, BLOCK_BYTES)))

    def _landing(self, region: Region) -> memoryview:
        """Where the current region's next bytes land."""
        if region.into is not None:
            return region.into[self._filled :]
        return self._held[self._filled :] if self._held is not None else self._scratch

    def _push(self, region: Region) -> None:
        if region.size:
            self._regions.append(region)
        elif region.then is not None:
            region.then(memoryview(b""))


Sink = Regions  # what a receive scatters into (deltas.Rebuild, the client's PlacedReceiver)


def receive_chunks(chunks: Iterable[object], into: memoryview | Sink, progress: Progress | None = None) -> None:
    """Every chunk into `into` in order; ValueError for a non-chunk, or more or fewer bytes than fit."""
    sink = Regions(into.nbytes, Region(into.nbytes, into)) if isinstance(into, memoryview) else into
    received = 0
    for chunk in chunks:
        if not isinstance(chunk, memoryview):
            raise ValueError(f"expected a chunk, got {type(chunk).__name__}")
        received += chunk.nbytes
        if received > sink.nbytes:
            raise ValueError(f"more than the announced {sink.nbytes} bytes")
        while chunk.nbytes:
            target = sink.target(chunk.nbytes)
            target[:] = chunk[: target.nbytes]
            sink.advance(target.nbytes)
            chunk = chunk[target.nbytes :]
        if progress is not None:
            progress(received, sink.nbytes)
    if received != sink.nbytes:
        raise ValueError("the stream was cut short")
