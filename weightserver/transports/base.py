"""ServerTransport: how a payload leaves this server for a fetch, and how a publish's bytes come in.

Negotiate asks each transport the caller accepts, in the caller's order, for an offer; the
first that makes one is the answer, and the stream (Fetch, Publish chunks) is the fallback
every server has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from weightserver.publish.incoming import IncomingPublish
    from weightserver.publish.receiver import IncomingModel
    from weightserver.storage.payloads import Payload
    from weightserver.storage.store import Version
    from weightserver.v1 import weights_pb2 as pb


class ServerTransport(Protocol):
    name: str  # what its transfers are logged and counted under
    kind: int  # its pb.Transport value

    async def offer(self, record: Version, payload: Payload, description: pb.Payload) -> bool:
        """Describe in `description` where the caller takes `payload` of `record`; False when this
        transport cannot carry it now (the next one is asked)."""
        ...

    def offer_incoming(self, incoming: IncomingPublish, description: pb.Payload) -> bool:
        """The same for a publish's bytes as they land (cut-through)."""
        ...

    def stage(self, header: pb.PublishHeader, owner: bytes | None, description: pb.Payload) -> IncomingModel | None:
        """Set up the upload of `header`'s bytes that only `owner` may name, described in
        `description`; None when this transport cannot take it now. Blocks: off the loop."""
        ...
