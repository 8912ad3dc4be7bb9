"""Ways to move a payload (gRPC stream, bulk TCP, shared memory): one Protocol, tried in TransportChain's order."""

from weightclient.transports.base import (
    NotOffered,
    NotVisibleHere,
    Offer,
    OutgoingFile,
    PayloadGone,
    Transport,
    TransportChain,
    TransportFailed,
)
from weightclient.transports.bulk import BulkTransport
from weightclient.transports.shared_memory import SharedMemoryTransport
from weightclient.transports.stream import StreamTransport

__all__ = [
    "BulkTransport",
    "NotOffered",
    "NotVisibleHere",
    "Offer",
    "OutgoingFile",
    "PayloadGone",
    "SharedMemoryTransport",
    "StreamTransport",
    "Transport",
    "TransportChain",
    "TransportFailed",
]
