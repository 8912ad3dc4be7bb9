"""Retention: a model keeps its `keep` newest unpinned versions and every pinned one."""

from __future__ import annotations

import bisect

from weightserver.protocol.errors import DescriptionTooLarge
from weightserver.protocol.limits import MAX_DESCRIPTIONS_PER_REPLY
from weightserver.storage.index import ModelState, Version


def evict(state: ModelState, keep: int) -> list[Version]:
    """Drop the unpinned versions beyond the `keep` newest; the dropped. Caller holds the lock."""
    unpinned = [v for v in state.versions.values() if not v.pinned]
    doomed = unpinned[: max(0, len(unpinned) - keep)]
    for record in doomed:
        del state.versions[record.version]
        bisect.insort(state.removed, record.version)
    return doomed


def check_listing(state: ModelState, record: Version, keep: int) -> None:
    """The descriptions retained with `record` must fit one ListVersions reply (only a publish
    retains more). Caller holds the lock."""
    versions = [*state.versions.values(), record]
    unpinned = [v for v in versions if not v.pinned]
    total = sum(v.description_bytes for v in versions if v.pinned) + sum(v.description_bytes for v in unpinned[-keep:])
    if total > MAX_DESCRIPTIONS_PER_REPLY:
        raise DescriptionTooLarge(
            f"model {record.model!r}: with this version the descriptions of its retained versions would add up to "
            f"{total} bytes, over the {MAX_DESCRIPTIONS_PER_REPLY} bytes one ListVersions reply may carry to a gRPC "
            "client with default settings; unpin or delete versions, or lower --keep"
        )
