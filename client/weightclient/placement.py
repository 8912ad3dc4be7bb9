"""Placed fetches: tensors received straight into the caller's memory, hashed block by block."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import xxhash

from weightserver.protocol.digests import PREFIX_BYTES
from weightserver.protocol.framing import Region, Regions
from weightserver.protocol.version_info import VersionInfo

Placement = Callable[[VersionInfo], Mapping[str, memoryview] | None]
"""Before a version's bytes move: {tensor name: a writable view} to place (others dropped), or None."""


def checked_views(place: Placement, info: VersionInfo) -> dict[str, memoryview] | None:
    views = place(info)
    if not views:
        return None
    tensors = {t.name: t for t in info.tensors}
    for name, view in views.items():
        entry = tensors.get(name)
        if entry is None or not entry.xxh3 or view.readonly or view.nbytes != entry.nbytes:
            return None
    return {name: view.cast("B") if view.format != "B" else view for name, view in views.items()}


def layout(info: VersionInfo, views: Mapping[str, memoryview], header_bytes: int) -> list[tuple[int, str | None]]:
    """The file after its prefix as (size, tensor to place or None) regions; ValueError if off."""
    regions: list[tuple[int, str | None]] = [(header_bytes, None)]
    position = 0
    for entry in sorted(info.tensors, key=lambda t: t.begin):
        if entry.begin < position:
            raise ValueError(f"tensor {entry.name!r} overlaps the one before it")
        regions.append((entry.begin - position, None))  # the gap before it (dropped below if none)
        regions.append((entry.nbytes, entry.name if entry.name in views else None))
        position = entry.end
    trailing = info.byte_size - PREFIX_BYTES - header_bytes - position
    if trailing < 0:
        raise ValueError(f"a {header_bytes}-byte header and {position} bytes of tensors exceed {info.byte_size} bytes")
    regions.append((trailing, None))
    return [(size, name) for size, name in regions if size]


class PlacedReceiver(Regions):
    """A framing.Sink scattering a file into the views (the rest dropped), each hashed as it lands;
    `bad()`: the ones that fail."""

    def __init__(self, info: VersionInfo, views: Mapping[str, memoryview]) -> None:
        self._info, self._views = info, views
        self._hashers = {name: xxhash.xxh3_128() for name in views}
        super().__init__(info.byte_size, Region(PREFIX_BYTES, then=self._plan))

    def bad(self) -> list[str]:
        return mismatched(self._info, self._hashers)

    def _plan(self, prefix: memoryview) -> None:
        for size, name in layout(self._info, self._views, int.from_bytes(prefix, "little")):
            self._push(Region(size, self._views.get(name), hasher=self._hashers.get(name)))


def mismatched(info: VersionInfo, hashers: Mapping[str, xxhash.xxh3_128]) -> list[str]:
    expected = {t.name: t.xxh3 for t in info.tensors}
    return [name for name, hasher in hashers.items() if hasher.hexdigest() != expected[name]]
