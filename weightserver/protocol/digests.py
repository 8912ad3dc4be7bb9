"""Digests, the one helper set: xxh3-128 (of a file, of each tensor) and sha256, in one pass
or (`IncomingDigests`) while an incoming publish's bytes arrive, each stretch hashed while it
is still in cache. sha256 costs ten times xxh3's CPU: computed only where one is checked."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from weightserver.protocol.safetensors_format import SafetensorsHeader, parse_header

if TYPE_CHECKING:
    from concurrent.futures import Executor

PREFIX_BYTES = 8  # the safetensors header's length prefix
BLOCK_BYTES = 1 << 20  # hashed by every digest in turn while it is in cache


def xxh3_hex(*parts: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of `parts` one after the other."""
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_digests(data: bytes | bytearray | memoryview, header: SafetensorsHeader) -> dict[str, str]:
    view, start = memoryview(data), header.data_start
    return {t.name: xxh3_hex(view[start + t.begin : start + t.end]) for t in header.tensors}


@dataclass(frozen=True)
class FileDigests:
    """What `IncomingDigests.finish` found: the digests and the header they were cut by."""

    xxh3: str
    tensor_xxh3: dict[str, str] = field(repr=False)
    header: SafetensorsHeader = field(repr=False)
    sha256: str | None = None  # None: not computed
    declared: bool = False  # the publisher's xxh3s, taken unread (a sealed same-host upload): checked later


def rehashed(data: bytes | bytearray | memoryview, header: SafetensorsHeader) -> FileDigests:
    """Every digest, sha256 included, of a file whose header is parsed."""
    return FileDigests(xxh3_hex(data), tensor_digests(data, header), header, sha256_hex(data))


class IncomingDigests:
    """Hashes `buffer` front to back as `advance(end)` fills it; a header that breaks `header_limits`
    (parse_header's) raises InvalidSafetensors as soon as it is in, so a bad transfer stops early."""

    def __init__(self, buffer: memoryview, *, sha256: bool = False, header_limits: dict | None = None) -> None:
        self.buffer = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        self.hashed = 0
        self._limits = header_limits or {}
        self._xxh3 = xxhash.xxh3_128()
        self._sha256 = hashlib.sha256() if sha256 else None
        self._header: SafetensorsHeader | None = None
        self._tensors: list[tuple[str, int, int, xxhash.xxh3_128]] = []  # (name, file begin, end, hasher), in order
        self._next = 0  # the first tensor not wholly hashed

    @property
    def parsed(self) -> bool:
        """The header is in: the bytes before `hashed` are not read again."""
        return self._header is not None

    def advance(self, end: int, *, spans: Executor | None = None) -> None:
        """Hash bytes [hashed, end), a block at a time: the second digest finds it in cache. With `spans` (once the
        header is parsed, and no sha256), the file's digest of the range is taken there while this thread takes the
        tensors': two cores for the two passes."""
        if spans is not None and self._header is not None and self._sha256 is None and end > self.hashed:
            span = spans.submit(self._xxh3.update, self.buffer[self.hashed : end])
            try:
                self._hash_tensors(self.hashed, end)
            finally:
                span.result()
            self.hashed = end
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
            self._parse(self.hashed)  # sets it, or raises for a file too short to hold one
        tensors = {name: hasher.hexdigest() for name, _, _, hasher in self._tensors}
        sha256 = self._sha256.hexdigest() if self._sha256 is not None else None
        return FileDigests(self._xxh3.hexdigest(), tensors, self._header, sha256)

    def _parse(self, end: int) -> None:
        """Parse the header once it is all in (or the file ends); hash the tensor bytes already here."""
        if end < min(PREFIX_BYTES, self.buffer.nbytes):
            return
        try:  # (a header over the limit, or past the file's end, is refused before it is all in)
            self._header = header = parse_header(self.buffer[:end], self.buffer.nbytes, **self._limits)
        except ValueError:  # the header is still to come
            return
        start = header.data_start
        self._tensors = [(t.name, start + t.begin, start + t.end, xxhash.xxh3_128()) for t in header.tensors]
        self._hash_tensors(0, self.hashed)

    def _hash_tensors(self, start: int, end: int) -> None:
        while self._next < len(self._tensors):
            _, begin, stop, hasher = self._tensors[self._next]
            lo, hi = max(begin, start), min(stop, end)
            if lo < hi:
                hasher.update(self.buffer[lo:hi])
            if stop > end:
                return
            self._next += 1
