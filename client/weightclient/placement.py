"""Placed fetches: tensors received straight into the caller's memory, hashed block by block."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import xxhash

from weightserver.protocol.digests import BLOCK_BYTES, PREFIX_BYTES
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
        if entry.begin > position:
            regions.append((entry.begin - position, None))
        regions.append((entry.nbytes, entry.name if entry.name in views else None))
        position = entry.end
    trailing = info.byte_size - PREFIX_BYTES - header_bytes - position
    if trailing < 0:
        raise ValueError(f"a {header_bytes}-byte header and {position} bytes of tensors exceed {info.byte_size} bytes")
    regions.append((trailing, None))
    return [(size, name) for size, name in regions if size]


class PlacedReceiver:
    """A framing.Sink scattering a file into the views (the rest to scratch); `bad()`: failed ones."""

    def __init__(self, info: VersionInfo, views: Mapping[str, memoryview]) -> None:
        self._info, self._views = info, views
        self._hashers = {name: xxhash.xxh3_128() for name in views}
        self._scratch = memoryview(bytearray(BLOCK_BYTES))
        self._prefix = memoryview(bytearray(PREFIX_BYTES))
        self._regions: list[tuple[int, str | None]] = []  # the rest of the file, reversed
        self._region: memoryview | None = self._prefix  # the region being filled: a view, or None for scratch
        self._name: str | None = None
        self._left = PREFIX_BYTES  # bytes still to come in this region
        self._remaining = self.nbytes = info.byte_size

    @property
    def done(self) -> bool:
        return self._remaining == 0

    def target(self, most: int = BLOCK_BYTES) -> memoryview:
        size = min(most, self._left, BLOCK_BYTES)
        if self._region is None:
            return self._scratch[:size]
        start = self._region.nbytes - self._left
        return self._region[start : start + size]

    def advance(self, n: int) -> None:
        if n > self._left or n > self._remaining:
            raise ValueError(f"{n} bytes do not fit the version's layout")
        if self._name is not None:
            start = self._region.nbytes - self._left
            self._hashers[self._name].update(self._region[start : start + n])
        self._left -= n
        self._remaining -= n
        while not self._left and not self.done:
            self._next_region()

    def bad(self) -> list[str]:
        return mismatched(self._info, self._hashers)

    def _next_region(self) -> None:
        if self._region is self._prefix:
            self._regions = layout(self._info, self._views, int.from_bytes(self._prefix, "little"))[::-1]
        if not self._regions:
            raise ValueError(f"the layout ends before the version's {self._info.byte_size} bytes")
        self._left, self._name = self._regions.pop()
        self._region = self._views[self._name] if self._name is not None else None


def mismatched(info: VersionInfo, hashers: Mapping[str, xxhash.xxh3_128]) -> list[str]:
    expected = {t.name: t.xxh3 for t in info.tensors}
    return [name for name, hasher in hashers.items() if hasher.hexdigest() != expected[name]]
