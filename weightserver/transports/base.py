"""ServerTransport: how a payload leaves this server for a fetch, and how a publish's bytes come in."""

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
        """Describe in `description` where the caller takes `payload`; False: it cannot now."""

    def offer_incoming(self, incoming: IncomingPublish, description: pb.Payload) -> bool:
        """The same for a publish's bytes as they land (cut-through)."""

    def stage(self, header: pb.PublishHeader, owner: bytes | None, description: pb.Payload) -> IncomingModel | None:
        """Set up an upload of `header`'s bytes that only `owner` may name; None: no room. Blocks."""
