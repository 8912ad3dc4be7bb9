"""What a fetch gets: the version it names, and the payload to send for it (itself, a delta, a cast)."""

from __future__ import annotations

import asyncio
import contextlib

from weightserver.protocol.digests import sha256_hex
from weightserver.protocol.errors import InvalidRequest, WeightServerError, clipped_repr
from weightserver.storage.payloads import CAST_TARGETS, Payload, PayloadCache
from weightserver.storage.store import Version, VersionStore
from weightserver.v1 import weights_pb2 as pb


def chosen_version(store: VersionStore, request: pb.FetchRequest) -> Version | None:
    """The version a fetch asks for; None when `newer_than` found nothing newer."""
    if request.dtype and request.dtype not in CAST_TARGETS:
        raise InvalidRequest(
            f"cannot cast to {clipped_repr(request.dtype)}: choose one of {', '.join(CAST_TARGETS)} or ''"
        )
    selector = request.WhichOneof("selector")
    if selector == "version":
        if request.version == 0:
            raise InvalidRequest("version must be >= 1 (leave it unset to fetch the latest)")
        return store.get(request.model, request.version)
    if selector == "newer_than":
        return store.newer_than(request.model, request.newer_than)
    return store.latest(request.model)


async def payload_for(
    store: VersionStore, payloads: PayloadCache, record: Version, request: pb.FetchRequest
) -> tuple[Payload, pb.Payload]:
    """What to send for `record` (the version itself, a delta or a cast) and its description."""
    base = None
    if request.base_version and request.base_version < record.version:
        with contextlib.suppress(WeightServerError):  # evicted or deleted: the caller gets every tensor
            base = store.get(record.model, request.base_version)
    if base is None and not request.dtype:
        payload = payloads.get(record)  # the version itself: nothing to build
    else:
        payload = await asyncio.to_thread(payloads.get, record, base, request.dtype)
    description = pb.Payload(
        byte_size=payload.byte_size,
        xxh3=payload.xxh3,
        base_version=payload.base_version,
        dtype=payload.dtype,
        base_xxh3=base.xxh3 if payload.base_version and base is not None else "",
    )
    return payload, description


async def sha256_of(store: VersionStore, record: Version) -> str:
    """The sha256 the store computes after an xxh3-only commit (here, if the version went first)."""
    try:
        return await asyncio.wrap_future(store.sha256_of(record))
    except WeightServerError:
        return await asyncio.to_thread(sha256_hex, record.data)
