"""The transport layer: one class per way of moving a payload, behind one Protocol (base.py):
the gRPC streams (stream.py), bulk TCP (bulk.py) and a same-host server's shared memory
(shared_memory.py), tried in the order and by the retry rule of base.TransportChain."""

from weightclient.transports.base import (
    NotOffered,
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
    "Offer",
    "OutgoingFile",
    "PayloadGone",
    "SharedMemoryTransport",
    "StreamTransport",
    "Transport",
    "TransportChain",
    "TransportFailed",
]
