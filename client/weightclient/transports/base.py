"""The contract every transport keeps: move one payload, in either direction.

A fetch gets an `Offer` (from Negotiate, or the head of the Fetch stream) and hands it to the
transport it names, which receives the bytes into a buffer or scatters the tensors into the
caller's views ("placed"). A publish negotiates each model's transport the same way: a fast
transport moves the bytes where the server said (`upload`), and the Publish stream then names
the upload instead of carrying chunks. Transports move bytes and say when they cannot
(`TransportFailed`); the caller verifies and falls back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb

Progress = Callable[[int, int], None]
"""Called as bytes move: (bytes so far, total bytes); may go back to 0 when a fetch starts over."""


class TransportFailed(Exception):
    """This transport cannot carry the payload here (another host, a closed port, bytes that
    fail their digests): the caller falls back to the next transport."""


class PayloadGone(TransportFailed):
    """The file the server named was removed before it could be read (the version was
    evicted meanwhile): the caller asks again for what it asked for, not for that version."""


class NotOffered(TransportFailed):
    """This transport does not carry payloads in this direction yet."""


@dataclass(frozen=True)
class Offer:
    """One payload, as negotiated: the version it belongs to, what its bytes are (the version
    itself, a delta or a cast: `payload`), and, for the stream, the open stream of chunks."""

    info: VersionInfo
    payload: pb.Payload
    chunks: Iterator[Any] | None = field(default=None, repr=False)
    # time.monotonic() by which the transfer must have ended (the fetch's timeout), or None.
    deadline: float | None = None

    @property
    def whole_version(self) -> bool:
        """Whether the payload is the version's own file (so its tensors can be placed)."""
        return not self.payload.base_version and not self.payload.dtype and self.payload.xxh3 == self.info.xxh3

    @property
    def label(self) -> str:
        return f"{self.info.model!r} v{self.info.version}"


@dataclass(frozen=True)
class OutgoingFile:
    """One model's safetensors file to publish: its header and its bytes as consecutive parts,
    or, once a fast transport moved them, the id of that upload (`uploaded`)."""

    header: pb.PublishHeader
    parts: Sequence[memoryview]
    uploaded: str = ""
    transport: Transport | None = None  # the one that moved them, when uploaded


class Transport(Protocol):
    """Moves one payload between a client and a server. One class per transport in this
    folder; `negotiation.TransportChain` orders them and applies the retry rule."""

    name: ClassVar[str]  # "stream", "bulk" or "shm": what FetchStats.transport reports
    kind: ClassVar[int]  # its pb.Transport value, as negotiated
    # Whether a publish writes the server's upload itself, front to back, with `progress`
    # called once bytes [0, n) are in place for good, so the caller may announce them
    # (PublishWritten) and the server verify them while the rest is written.
    written_in_place: ClassVar[bool]

    def upload(
        self, payload: pb.Payload, parts: Sequence[memoryview], *, deadline: float | None, progress: Progress | None
    ) -> str:
        """Move one model's file (`parts`, consecutive) where a publish's Negotiate answer
        says; the xxh3-128 (hex) of the bytes moved, hashed on the way. NotOffered for the
        stream, which carries a publish's bytes in the Publish call itself."""
        ...

    def prepare(self, payload: pb.Payload) -> None:
        """Get ready to `upload` into a publish's upload set up ahead (spare_uploads), so the
        upload itself costs only the copy. `release` undoes it when it goes unused."""
        ...

    def release(self, payload: pb.Payload) -> None:
        """Let go of what `prepare` held for `payload`, if anything."""
        ...

    def receive(self, offer: Offer, *, into: memoryview | None, progress: Progress | None) -> memoryview:
        """The offered payload's bytes, unverified, in `into` when it is large enough."""
        ...

    def receive_placed(self, offer: Offer, views: Mapping[str, memoryview]) -> list[str]:
        """The offered version's file scattered into `views` (tensor name -> writable view of
        its exact size; other bytes are dropped), each hashed as it lands: the names of the
        tensors whose digests do not match (normally none)."""
        ...


def receive_buffer(size: int, into: memoryview | None = None) -> memoryview:
    """`into[:size]` if it is large enough, else a writable, uninitialised byte buffer. Unlike
    bytearray(size) it is not zero-filled first, which for a large model costs as much as
    receiving it."""
    if into is not None and into.nbytes >= size and not into.readonly:
        return into.cast("B")[:size]
    import numpy as np

    return memoryview(np.empty(size, dtype=np.uint8))
