"""The safetensors file a fetch sends: the version, a delta (the tensors whose xxh3 differs from a
base version's), a cast (float32 as bfloat16 or float16), or both; derived ones built once, cached."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.errors import InvalidSafetensors
from weightserver.protocol.safetensors_format import (
    DTYPE_SIZES,
    SafetensorsHeader,
    TensorEntry,
    build_header,
    parse_header,
)

CAST_TARGETS = ("BF16", "F16")
CAST_BLOCK_VALUES = 1 << 22  # 16 MiB of float32 at a time: whole-tensor temporaries would cost several times its size
Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Payload:
    """A safetensors file to send, and what it is relative to the version it came from."""

    data: Bytes = field(repr=False)
    xxh3: str
    base_version: int = 0
    dtype: str = ""

    @property
    def byte_size(self) -> int:
        return len(self.data)


def cast_f32(data: memoryview, dtype: str) -> memoryview:
    """Little-endian float32 bytes -> `dtype` bytes, rounding to nearest even like torch."""
    import numpy as np  # only servers that cast pay for the import

    values = np.frombuffer(data, dtype="<f4")
    out = np.empty(values.size, dtype="<f2" if dtype == "F16" else "<u2")
    for start in range(0, values.size, CAST_BLOCK_VALUES):
        block = values[start : start + CAST_BLOCK_VALUES]
        if dtype == "F16":
            with np.errstate(over="ignore"):  # |x| > 65504 becomes inf, as in torch; no RuntimeWarning
                out[start : start + block.size] = block
            continue
        bits = block.view("<u4")
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        nan = np.isnan(block)
        if nan.any():  # rounding could carry a NaN's payload into infinity: keep it a quiet NaN
            rounded[nan] = ((bits[nan] >> 16) & 0x8000) | 0x7FC0
        out[start : start + block.size] = rounded
    return memoryview(out).cast("B")


def derive(
    data: Bytes, header: SafetensorsHeader, *, keep: Callable[[TensorEntry], bool] | None = None, dtype: str = ""
) -> bytes:
    """A new safetensors file with the tensors `keep` selects, float32 ones cast to `dtype`."""
    view, start = memoryview(data), header.data_start
    selected: list[tuple[TensorEntry, str, memoryview | bytes]] = []
    for entry in header.tensors:
        if keep is not None and not keep(entry):
            continue
        raw = view[start + entry.begin : start + entry.end]
        if dtype and entry.dtype == "F32":
            selected.append((entry, dtype, cast_f32(raw, dtype)))
        else:
            selected.append((entry, entry.dtype, raw))
    # Largest elements first keeps every tensor aligned, as in our own encoder.
    selected.sort(key=lambda item: (-DTYPE_SIZES[item[1]], item[0].name))
    prefix, _ = build_header((e.name, d, e.shape, len(raw)) for e, d, raw in selected)
    return b"".join([prefix, *(raw for _, _, raw in selected)])


def apply_delta(
    base: Bytes, base_header: SafetensorsHeader, layout: Sequence[TensorEntry], byte_size: int, delta: Bytes
) -> bytearray | None:
    """The inverse of `derive(..., keep=changed)`: the base with `delta`'s tensors written over; None when
    the target (`layout`, `byte_size`) is laid out otherwise. The caller checks the digest."""
    if len(base) != byte_size or [_placement(t) for t in base_header.tensors] != [_placement(t) for t in layout]:
        return None
    try:
        changed = parse_header(delta)
    except InvalidSafetensors:
        return None
    places = {t.name: t for t in base_header.tensors}
    rebuilt, source = bytearray(base), memoryview(delta)
    for entry in changed.tensors:
        place = places.get(entry.name)
        if place is None or (entry.dtype, entry.shape, entry.nbytes) != (place.dtype, place.shape, place.nbytes):
            return None
        start, begin = base_header.data_start + place.begin, changed.data_start + entry.begin
        rebuilt[start : start + place.nbytes] = source[begin : begin + entry.nbytes]
    return rebuilt


def _placement(entry: TensorEntry) -> tuple[str, str, tuple[int, ...], int, int]:
    return entry.name, entry.dtype, tuple(entry.shape), entry.begin, entry.end


class PayloadCache:
    """Builds derived payloads once (concurrent requests wait for the one build) and keeps them
    within `max_bytes`, least recently used dropped first."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, int, int, str], Payload] = OrderedDict()
        self._building: dict[tuple[str, int, int, str], threading.Event] = {}
        self.builds = 0  # how many payloads were derived (a cast happens once per version)

    def get(self, target, base=None, dtype: str = "") -> Payload:
        """The payload for `target` (a store Version): a delta against `base` (a Version of the same
        model, or None) and/or a cast to `dtype` (one of CAST_TARGETS: the servicer checks it)."""
        # A delta needs the same tensor names, dtypes and shapes, and a tensor that did not change (by digest).
        layout = {(t.name, t.dtype, t.shape) for t in target.header.tensors}
        if base is None or layout != {(t.name, t.dtype, t.shape) for t in base.header.tensors}:
            base, unchanged = None, set()
        else:
            unchanged = {name for name, xxh3 in target.tensor_xxh3.items() if base.tensor_xxh3.get(name) == xxh3}
        if not dtype and not unchanged:
            return Payload(target.data, target.xxh3)  # no cast, and no delta or every tensor changed
        key = (target.model, target.version, base.version if base is not None else 0, dtype)
        while True:
            with self._lock:
                payload = self._entries.get(key)
                if payload is not None:
                    self._entries.move_to_end(key)
                    return payload
                waiter = self._building.get(key)
                if waiter is None:
                    self._building[key] = threading.Event()
                    break
            waiter.wait()
        try:
            data = derive(target.data, target.header, keep=lambda e: e.name not in unchanged, dtype=dtype)
            payload = Payload(data, xxh3_hex(data), base.version if base is not None else 0, dtype)
            with self._lock:
                self.builds += 1
                self._entries[key] = payload
                total = sum(p.byte_size for p in self._entries.values())
                while total > self.max_bytes and len(self._entries) > 1:
                    total -= self._entries.popitem(last=False)[1].byte_size
            return payload
        finally:
            with self._lock:
                self._building.pop(key).set()

    def keys(self) -> list[tuple[str, int, int, str]]:
        with self._lock:
            return list(self._entries)

    def forget(self, model: str, version: int) -> None:
        """Drop every payload derived from (or against) an evicted version."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == model and version in (k[1], k[2])]:
                del self._entries[key]
