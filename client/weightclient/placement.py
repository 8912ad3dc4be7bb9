"""Placed fetches: a version's tensors received straight into memory the caller owns.

A collector that copies fetched tensors into its policy moves every byte twice: socket or
shared-memory file -> receive buffer -> parameters. When the caller names, before the bytes
move, where each tensor should land (its live parameters), the bulk and shared-memory paths
scatter the file into those tensors directly (`recv_into` / `preadv`; header, padding and
unplaced tensors into scratch or skipped). Each block is hashed right after it lands, while it
is still in cache, and every placed tensor is checked against the version's xxh3 digest; the
caller falls back to a normal fetch when one does not match.

Byte-level (memoryviews), no torch: `WeightClient.fetch(place=...)` supplies the views.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence

import xxhash

from weightclient.block_reader import read_blocks
from weightclient.version_info import VersionInfo

Placement = Callable[[VersionInfo], Mapping[str, memoryview] | None]
"""Called with a version's description before its bytes move: {tensor name: a writable view
of exactly that tensor's byte size} for the tensors to place (the others are received into
scratch and dropped), or None to receive the version normally."""

PREFIX_BYTES = 8  # a safetensors file starts with the header's length, u64 little-endian
BLOCK_BYTES = 1 << 20  # read and hash in blocks that stay in cache between the two


def checked_views(place: Placement, info: VersionInfo) -> dict[str, memoryview] | None:
    """The caller's views if every one fits its tensor and has a digest to verify it by."""
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
    """The file after its 8-byte prefix as (size, tensor to place or None) regions in file
    order: the header, gaps and unplaced tensors are None. Raises ValueError when the layout
    does not add up to the version's size."""
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


def read_file_into(path: str, info: VersionInfo, views: Mapping[str, memoryview]) -> list[str] | None:
    """Read a shared-memory file of `info.byte_size` bytes into `views`, hashing each block
    while it is still in cache. Returns the tensors whose digests do not match (normally
    none), or None when the file cannot be read here (another host, another size)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != info.byte_size:
            return None
        prefix = os.pread(fd, PREFIX_BYTES, 0)
        if len(prefix) != PREFIX_BYTES:
            return None
        offset = PREFIX_BYTES
        blocks: list[tuple[memoryview, int]] = []
        owners: list[str] = []  # the tensor of each block
        for size, name in layout(info, views, int.from_bytes(prefix, "little")):
            if name is not None:
                for start in range(0, size, BLOCK_BYTES):
                    blocks.append((views[name][start : start + BLOCK_BYTES], offset + start))
                    owners.append(name)
            offset += size
        digests = _Digests(info)
        hashers: dict[str, xxhash.xxh3_128] = {}

        def landed(i: int) -> None:
            name = owners[i]
            hasher = hashers.setdefault(name, xxhash.xxh3_128())
            hasher.update(blocks[i][0])
            if i + 1 == len(owners) or owners[i + 1] != name:
                digests.check(name, hasher)

        read_blocks(fd, blocks, landed)
        for name in views:
            if name not in hashers:  # an empty tensor: no blocks, nothing read
                digests.check(name, xxhash.xxh3_128())
        return digests.bad
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def recv_placed(conn: socket.socket, info: VersionInfo, views: Mapping[str, memoryview]) -> list[str]:
    """Receive a version's file from `conn` into `views` (the rest into scratch), hashing as
    it arrives. Returns the tensors whose digests do not match (normally none)."""
    prefix = memoryview(bytearray(PREFIX_BYTES))
    recv_parts(conn, [prefix])
    try:
        regions = layout(info, views, int.from_bytes(prefix, "little"))
    except ValueError as exc:
        raise OSError(f"bulk payload does not match its description: {exc}") from exc
    scratch = memoryview(bytearray(BLOCK_BYTES))
    digests = _Digests(info)
    for size, name in regions:
        if name is None:
            for start in range(0, size, BLOCK_BYTES):
                recv_parts(conn, [scratch[: min(BLOCK_BYTES, size - start)]], started=True)
            continue
        view, hasher, received = views[name], xxhash.xxh3_128(), 0
        while received < size:
            n = conn.recv_into(view[received:], min(BLOCK_BYTES, size - received))
            if not n:
                raise OSError("bulk connection closed part-way through a transfer")
            hasher.update(view[received : received + n])
            received += n
        digests.check(name, hasher)
    return digests.bad


def recv_parts(conn: socket.socket, parts: Sequence[memoryview], *, started: bool = False) -> None:
    """Fill every part from `conn`, in order. EOFError if the peer closed before the first
    byte (a kept connection the server dropped), OSError if it closed part-way."""
    for part in parts:
        received = 0
        while received < part.nbytes:
            n = conn.recv_into(part[received:])
            if not n:
                if not started and received == 0:
                    raise EOFError("the bulk connection was closed")
                raise OSError("bulk connection closed part-way through a transfer")
            received += n
            started = True


class _Digests:
    """Collects the placed tensors whose xxh3 does not match the version's manifest."""

    def __init__(self, info: VersionInfo) -> None:
        self.expected = {t.name: t.xxh3 for t in info.tensors}
        self.bad: list[str] = []

    def check(self, name: str, hasher: xxhash.xxh3_128) -> None:
        if hasher.hexdigest() != self.expected[name]:
            self.bad.append(name)
