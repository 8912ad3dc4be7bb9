"""The contract every transport keeps: move one payload either way (`receive` an `Offer`, or `upload` where Negotiate
said); one that cannot raises `TransportFailed`, and rests `rest_seconds` while the caller falls back along a
`TransportChain` ("auto": shm, bulk, stream)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

from weightclient.core.retry import NEVER, Deadline
from weightclient.placement import PlacedReceiver
from weightserver.protocol import page_tables
from weightserver.protocol.errors import InvalidRequest
from weightserver.protocol.framing import Progress, Sink, receive_chunks
from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

Parts = Sequence[memoryview]  # one model's file, as consecutive parts (not joined)
Into = memoryview | Sink | None  # where a receive lands: a buffer (else a fresh one), or a Sink (placed, rebuilt)
Answer = pb.NegotiateResponse | None  # Negotiate's; None where the stream's Fetch is asked directly


class TransportFailed(Exception):
    """This transport cannot carry the payload here: the caller falls back to the next."""


class NotVisibleHere(TransportFailed):
    """The server's files are not visible from this process (another host, container or mount namespace): the
    transport stays off for this server rather than failing again every `rest_seconds`."""


class PayloadGone(TransportFailed):
    """The file the server named was removed (evicted) before it was read: ask again."""


class NotOffered(TransportFailed):
    pass


@dataclass(frozen=True)
class Offer:
    info: VersionInfo
    payload: pb.Payload
    chunks: Iterator[Any] | None = field(default=None, repr=False)
    deadline: Deadline = NEVER  # by when the transfer must have ended
    # Else (a publish's bytes at its publisher's pace, a large version over a slow link) no wait for bytes,
    # the first included, longer than this (0: no such bound).
    stall: float = 0.0

    @property
    def whole_version(self) -> bool:
        return not self.payload.base_version and not self.payload.dtype and self.payload.xxh3 == self.info.xxh3

    @property
    def label(self) -> str:
        return f"{self.info.model!r} v{self.info.version}" if self.info.version else f"{self.info.model!r} (incoming)"


class Uploaded(NamedTuple):
    """The file's xxh3-128 and, where a same-host upload hashed them where they landed, each tensor's
    (the server commits them as declared)."""

    xxh3: str
    tensor_xxh3: Mapping[str, str] | None = None


@dataclass(frozen=True)
class OutgoingFile:
    header: pb.PublishHeader
    parts: Parts
    uploaded: str = ""  # the upload that holds the bytes, else the Publish call carries them
    transport: Transport | None = None
    tensor_xxh3: Mapping[str, str] | None = None  # declared with `uploaded` (Uploaded.tensor_xxh3)


class Transport(Protocol):
    name: ClassVar[str]  # "stream", "bulk", "shm": what FetchStats.transport reports
    kind: ClassVar[int]  # its pb.Transport value

    def offer(
        self, request: pb.FetchRequest, answer: Answer, deadline: Deadline, info: VersionInfo, stall: float = 0.0
    ) -> Offer | None:
        """The payload `answer` describes; `info` stands in for a version not committed yet (`stall`: see Offer)."""
        assert answer is not None, "a fast transport is only ever picked by Negotiate"
        version = VersionInfo.from_proto(answer.header) if answer.HasField("header") else info
        return Offer(version, answer.payload, deadline=NEVER if stall else deadline, stall=stall)

    def upload(self, payload: pb.Payload, parts: Parts, *, deadline: Deadline, progress: Progress | None) -> Uploaded:
        """Move one model's file where Negotiate said; the digests of the bytes moved."""
        raise NotOffered(f"{self.name} carries no uploads")

    def prepare(self, payload: pb.Payload) -> None:
        """Get ready for an `upload` set up ahead, so it costs only the copy."""

    def release(self, payload: pb.Payload) -> None:
        """Let go of what `prepare` held."""

    def receive(self, offer: Offer, *, into: Into, progress: Progress | None) -> memoryview:
        """The payload's bytes, unverified: in `into` if a buffer large enough; through it if a Sink (returns none)."""

    def sealed(self, data: memoryview) -> bool:
        """Whether `data` maps a file sealed before its commit: the version itself, with nothing to check against."""
        return False

    def receive_placed(self, offer: Offer, views: Mapping[str, memoryview]) -> list[str]:
        """The version's file scattered into `views`, hashed as it lands: the tensors that fail."""
        receiver = PlacedReceiver(offer.info, views)
        self.receive(offer, into=receiver, progress=None)
        return receiver.bad()


class TransportChain:
    def __init__(self, fast: Sequence[Transport], stream: Transport, *, rest_seconds: float = 60.0) -> None:
        self.fast, self.stream, self.rest_seconds = list(fast), stream, rest_seconds
        self.by_name: dict[str, Transport] = {t.name: t for t in (*self.fast, stream)}
        self.by_kind: dict[int, Transport] = {t.kind: t for t in (*self.fast, stream)}
        self._failed_at: dict[str, float] = {}
        self._worked: set[str] = set()

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *self.by_name)

    def order(self, choice: str) -> list[Transport]:
        if choice == "auto":
            return [*(t for t in self.fast if not self.resting(t)), self.stream]
        if choice not in self.by_name:
            raise InvalidRequest(f"transport must be one of {', '.join(self.choices)}, got {choice!r}")
        return [self.stream] if choice == self.stream.name else [self.by_name[choice], self.stream]

    def resting(self, transport: Transport) -> bool:
        failed = self._failed_at.get(transport.name)
        return failed is not None and time.monotonic() - failed < self.rest_seconds

    def failed(self, transport: Transport, reason: object) -> None:
        self._worked.discard(transport.name)
        if isinstance(reason, NotVisibleHere):  # no use asking again: an expected setup (compose), not a fault
            if self._failed_at.get(transport.name) != math.inf:
                log.info("%s transport is off for this server: %s", transport.name, reason)
            self._failed_at[transport.name] = math.inf  # resting until it works (it is not asked to)
            return
        if not self.resting(transport):
            log.warning(
                "%s transport failed (%s); using the next one for %.0fs", transport.name, reason, self.rest_seconds
            )
        self._failed_at[transport.name] = time.monotonic()

    def worked(self, transport: Transport) -> None:
        self._failed_at.pop(transport.name, None)
        self._worked.add(transport.name)

    def usable(self, name: str) -> bool | None:
        return False if self.resting(self.by_name[name]) else (name in self._worked) or None


def is_sink(into: Into) -> bool:
    return into is not None and not isinstance(into, memoryview)


def into_sink(data: memoryview, into: Into) -> memoryview:
    """`data` (a payload a transport holds whole, bytes), or passed through `into` when that is a Sink."""
    if not is_sink(into):
        return data
    receive_chunks([data], into)
    return memoryview(b"")


def blocks(parts: Parts, size: int, progress: Progress | None) -> Iterator[memoryview]:
    """`parts` cut into blocks of `size` bytes; `progress` hears of each once the caller moved it."""
    total, done = sum(p.nbytes for p in parts), 0
    for part in parts:
        for start in range(0, part.nbytes, size):
            block = part[start : start + size]
            yield block
            done += block.nbytes
            if progress is not None:
                progress(done, total)


def receive_buffer(size: int, into: memoryview | None = None, *, huge: bool = False) -> memoryview:
    """`into[:size]` if large enough, else fresh anonymous memory (`huge`: for a buffer kept from fetch to fetch)."""
    if into is not None and into.nbytes >= size and not into.readonly:
        return into.cast("B")[:size]
    return page_tables.anonymous(size, huge=huge)
