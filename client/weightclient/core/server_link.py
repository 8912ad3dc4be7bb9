"""ServerLink: one server address's channel and the transports that use it; ServerLinks: the
addresses a client may use, in order, and the one it uses now.

A client given several addresses (`"relay-a:50052,primary:50051"`) uses the first, and moves to
the next when a call finds its server down or stalled (`move_on`), round and round. Versions
keep their numbers and bytes across a primary and its relays, so the move is safe; a server that
is behind the version a caller holds answers CursorOutOfRange for anything newer, which the
caller reads as "nothing newer here", never as a version to go back to.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from weightclient.transports import BulkTransport, SharedMemoryTransport, StreamTransport, TransportChain
from weightserver.v1 import weights_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RETIRED_LINKS = 2  # links moved away from, kept open for calls still running on them


@dataclass
class ServerLink:
    """A channel to one address, its stub, and the transports bound to it (the shared-memory
    transport is the client's, whatever the address)."""

    address: str
    channel: grpc.Channel
    stub: pb_grpc.WeightServiceStub
    stream: StreamTransport
    bulk: BulkTransport
    early_bulk: BulkTransport  # for bytes received as they arrive: such a transfer lasts a publish
    transports: TransportChain

    def close(self) -> None:
        self.bulk.close()
        self.early_bulk.close()
        self.channel.close()


def parse_addresses(address: str | Sequence[str]) -> list[str]:
    """`"a:1,b:2"` (or a sequence) -> ["a:1", "b:2"]; ValueError when none is given."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    addresses = [part.strip() for part in parts if part.strip()]
    if not addresses:
        raise ValueError(f"no server address in {address!r}")
    return addresses


class ServerLinks:
    """The link in use among `addresses`, made by `connect(address)`."""

    def __init__(self, addresses: Sequence[str], connect: Callable[[str], ServerLink]) -> None:
        self.addresses = list(addresses)
        self._connect = connect
        self._lock = threading.Lock()
        self._index = 0
        self.current = connect(self.addresses[0])
        self._retired: list[ServerLink] = []

    def move_on(self, failed: str, why: object) -> bool:
        """The server at `failed` is down or stalled: use the next address (if another thread
        moved on already, keep its choice). False when there is no other address."""
        if len(self.addresses) == 1:
            return False
        with self._lock:
            if self.current.address != failed:
                return True
            self._index = (self._index + 1) % len(self.addresses)
            retired, self.current = self.current, self._connect(self.addresses[self._index])
            # Calls still running on the old link (a Watch, a fetch) end on their own.
            self._retired.append(retired)
            while len(self._retired) > RETIRED_LINKS:
                self._retired.pop(0).close()
        log.warning("server %s is down or stalled (%s); moving to %s", failed, why, self.current.address)
        return True

    def close(self) -> None:
        with self._lock:
            links, self._retired = [self.current, *self._retired], []
        for link in links:
            link.close()


def connector(
    open_channel: Callable[[str], grpc.Channel],
    metadata: object,
    chunk_bytes: int,
    shm: SharedMemoryTransport,
    host_of: Callable[[str], str],
) -> Callable[[str], ServerLink]:
    """A `connect(address)` for ServerLinks: a channel from `open_channel` and transports on it."""

    def connect(address: str) -> ServerLink:
        channel = open_channel(address)
        bulk = BulkTransport(host_of(address))
        stream = StreamTransport(channel, metadata, chunk_bytes)
        return ServerLink(
            address=address,
            channel=channel,
            stub=pb_grpc.WeightServiceStub(channel),
            stream=stream,
            bulk=bulk,
            early_bulk=BulkTransport(host_of(address)),
            transports=TransportChain([shm, bulk], stream),
        )

    return connect
