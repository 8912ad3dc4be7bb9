"""The transport layer: one class per way of moving a payload, behind one Protocol.

base.py          Transport (Protocol), Offer, OutgoingFile, TransportFailed
stream.py        StreamTransport: the Fetch and Publish gRPC streams (always there)
bulk.py          BulkTransport: a plain TCP connection to the server's bulk port
shared_memory.py SharedMemoryTransport: files in a same-host server's shared memory
negotiation.py   TransportChain: the order they are tried in, and the one retry rule
"""

from weightclient.transports.base import NotOffered, Offer, OutgoingFile, PayloadGone, Transport, TransportFailed
from weightclient.transports.bulk import BulkTransport
from weightclient.transports.negotiation import TransportChain
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
