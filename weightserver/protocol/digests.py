"""IncomingDigests: a file's digests computed while its bytes arrive, not in a pass after.

A publish's bytes land in a buffer in order (chunks of the stream, a bulk socket, a writer's
shared-memory file read back in blocks). Each newly arrived stretch is hashed at once, while it
is still in cache: xxh3-128 of the whole file, xxh3-128 of each tensor (from the moment the
safetensors header is in), and sha256 when asked for (it is ten times the CPU of xxh3, so only
where a publisher declared one to check).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import xxhash

from weightserver.protocol.safetensors_format import DEFAULT_MAX_HEADER_BYTES, SafetensorsHeader, parse_header

PREFIX_BYTES = 8  # the safetensors header's length prefix
BLOCK_BYTES = 1 << 20  # hashed by every digest in turn while it is in cache


@dataclass(frozen=True)
class FileDigests:
    """What `IncomingDigests.finish` found: the digests and the header they were cut by."""

    xxh3: str
    tensor_xxh3: dict[str, str] = field(repr=False)
    header: SafetensorsHeader = field(repr=False)
    sha256: str | None = None  # None: not computed


class IncomingDigests:
    """Hashes `buffer` front to back as `advance(end)` says how far it is filled.

    `header_limits` are parse_header's keyword limits; a header that breaks them or is not a
    safetensors header raises InvalidSafetensors from `advance` as soon as it is complete, so a
    transfer of a malformed file can stop early.
    """

    def __init__(self, buffer: memoryview, *, sha256: bool = False, header_limits: dict | None = None) -> None:
        self.buffer = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        self.hashed = 0
        self._limits = header_limits or {}
        self._xxh3 = xxhash.xxh3_128()
        self._sha256 = hashlib.sha256() if sha256 else None
        self._header: SafetensorsHeader | None = None
        self._tensors: list[tuple[str, int, int]] = []  # (name, file begin, file end), in file order
        self._next = 0  # the first tensor not wholly hashed
        self._tensor_hashers: dict[str, xxhash.xxh3_128] = {}

    def advance(self, end: int) -> None:
        """Bytes [hashed, end) of the buffer are in place: hash them, a block at a time, so
        that each byte is read from memory once whatever the stretch (the second digest of a
        block finds it in cache)."""
        while self.hashed < end:
            stop = min(end, self.hashed + BLOCK_BYTES)
            block = self.buffer[self.hashed : stop]
            self._xxh3.update(block)
            if self._sha256 is not None:
                self._sha256.update(block)
            if self._header is None:
                self._parse(stop)
            if self._header is not None:
                self._hash_tensors(self.hashed, stop)
            self.hashed = stop

    def finish(self) -> FileDigests:
        """The digests once every byte is in (ValueError before)."""
        if self.hashed != self.buffer.nbytes:
            raise ValueError(f"{self.hashed} of {self.buffer.nbytes} bytes hashed")
        if self._header is None:
            self._parse(self.hashed)  # raises for a file too short to hold its header
        assert self._header is not None
        return FileDigests(
            xxh3=self._xxh3.hexdigest(),
            tensor_xxh3={name: hasher.hexdigest() for name, hasher in self._tensor_hashers.items()},
            header=self._header,
            sha256=self._sha256.hexdigest() if self._sha256 is not None else None,
        )

    def _parse(self, end: int) -> None:
        """Parse the header once it is all in (or the file ends), and start hashing tensors
        from the bytes already here."""
        size = self.buffer.nbytes
        if end < min(PREFIX_BYTES, size):
            return
        length = int.from_bytes(self.buffer[:PREFIX_BYTES], "little") if end >= PREFIX_BYTES else 0
        too_long = length > self._limits.get("max_header_bytes", DEFAULT_MAX_HEADER_BYTES)
        if end < size and end < PREFIX_BYTES + length and not too_long:
            return  # parse_header refuses a header over the limit before it is all in
        header = parse_header(self.buffer[:end], size, **self._limits)
        self._header = header
        self._tensors = [(t.name, header.data_start + t.begin, header.data_start + t.end) for t in header.tensors]
        self._tensor_hashers = {name: xxhash.xxh3_128() for name, _, _ in self._tensors}
        self._hash_tensors(0, self.hashed)

    def _hash_tensors(self, start: int, end: int) -> None:
        """Feed bytes [start, end) to the tensors they belong to."""
        while self._next < len(self._tensors):
            name, begin, stop = self._tensors[self._next]
            if begin >= end:
                return
            lo, hi = max(begin, start), min(stop, end)
            if lo < hi:
                self._tensor_hashers[name].update(self.buffer[lo:hi])
            if stop > end:
                return
            self._next += 1
