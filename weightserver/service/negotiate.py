"""Negotiate: the first transport the caller accepts (in its order) that makes an offer, else the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from weightserver.protocol.version_info import version_message
from weightserver.publish.incoming import IncomingPublish
from weightserver.service.fetch import payload_for
from weightserver.storage.payloads import Payload, PayloadCache
from weightserver.storage.store import Version, VersionStore
from weightserver.transports.base import ServerTransport
from weightserver.v1 import weights_pb2 as pb

Transports = Mapping[int, ServerTransport]


async def fetch(
    transports: Transports,
    store: VersionStore,
    payloads: PayloadCache,
    record: Version | None,
    request: pb.NegotiateRequest,
) -> tuple[pb.NegotiateResponse, ServerTransport | None, Payload | None]:
    """The answer for a fetch of `record`, with the transport and payload (None, None: the stream)."""
    answer = pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
    if record is None:
        answer.up_to_date.latest_version = request.fetch.newer_than
        return answer, None, None
    answer.header.CopyFrom(version_message(record))
    for transport in filter(None, map(transports.get, request.accept)):
        payload, description = await payload_for(store, payloads, record, request.fetch)
        if await transport.offer(record, payload, description):
            answer.payload.CopyFrom(description)
            answer.transport = transport.kind
            return answer, transport, payload
    return answer, None, None


def incoming(transports: Transports, announced: IncomingPublish, request: pb.NegotiateRequest) -> pb.NegotiateResponse:
    answer = pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
    for transport in filter(None, map(transports.get, request.accept)):
        if transport.offer_incoming(announced, answer.payload):
            answer.transport = transport.kind
            answer.payload.byte_size = announced.byte_size
            break
    return answer


async def publish(transports: Transports, request: pb.NegotiateRequest, owner: bytes | None) -> pb.NegotiateResponse:
    """Stage one model's upload, that only `owner` may name, on the first transport with room."""
    header, answer = request.publish, pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
    # The stream stages nothing: asked first, it would wait for a default thread (casts hold them).
    accept = [kind for kind in request.accept if kind != pb.TRANSPORT_STREAM] if header.total_bytes else []
    for transport in filter(None, map(transports.get, accept)):
        upload = await asyncio.to_thread(transport.stage, header, owner, answer.payload)
        if upload is not None:
            answer.transport = transport.kind
            answer.payload.byte_size = header.total_bytes
            answer.upload = upload.id
            break
    return answer
