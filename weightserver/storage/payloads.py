"""The safetensors file a fetch sends: the version or a selection of it (some tensors, or slices of
them), a delta (the tensors whose xxh3 differs from a base version's, whole or as element deltas),
a cast (float32 as bfloat16 or float16), or both; derived ones built once, cached."""

from __future__ import annotations

import bisect
import itertools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from weightserver.protocol import deltas
from weightserver.protocol.deltas import ENCODING_KEY
from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.safetensors_format import DTYPE_SIZES, SafetensorsHeader, TensorEntry, build_header
from weightserver.protocol.selection import Cut, Resolved

CAST_TARGETS = ("BF16", "F16")
ENCODE_THREADS = 2
THREADED_DELTA_BYTES = 4 << 20  # below, starting the threads costs more than they save (the DDPG actor: 18 kB)
CAST_BLOCK_VALUES = 1 << 22  # 16 MiB of float32 at a time: whole-tensor temporaries would cost several times its size
Bytes = bytes | bytearray | memoryview


class Pieces:
    """A file as consecutive views, sent and written as they are, never joined: a selection's header,
    then each tensor (see `select_file`). `owned`: the bytes made for it; the rest are the version's."""

    def __init__(self, views: Sequence[memoryview], owned: int) -> None:
        self.views, self.owned = tuple(views), owned
        self._starts = list(itertools.accumulate((v.nbytes for v in self.views), initial=0))
        self.nbytes = self._starts[-1]

    def __len__(self) -> int:
        return self.nbytes

    def span(self, begin: int, end: int) -> memoryview:
        """Bytes [begin, end), which lie in one piece (as each tensor does)."""
        if begin == end:  # an empty tensor: placed last, it starts where the last piece ends
            return memoryview(b"")
        i = bisect.bisect_right(self._starts, begin) - 1
        view, at = self.views[i], begin - self._starts[i]
        if end - begin > view.nbytes - at:
            raise ValueError(f"bytes [{begin}, {end}) span pieces")
        return view[at : at + end - begin]


File = Bytes | Pieces


def tensor_span(data: File, header: SafetensorsHeader, entry: TensorEntry) -> memoryview:
    """`entry`'s bytes in a file, joined or in pieces."""
    begin, end = header.data_start + entry.begin, header.data_start + entry.end
    return data.span(begin, end) if isinstance(data, Pieces) else memoryview(data)[begin:end]


# model, version, base version, dtype, element delta forms ("+"-joined), selection (Resolved.key)
PayloadKey = tuple[str, int, int, str, str, str]


@dataclass(frozen=True)
class SelectionManifest:
    """A selection's own file described as a version is (the proto's SelectionInfo); `key`: Resolved.key."""

    key: str
    byte_size: int
    xxh3: str
    header: SafetensorsHeader = field(repr=False)
    tensor_xxh3: Mapping[str, str] = field(repr=False)


@dataclass(frozen=True)
class Selected:
    """A version seen through a selection: its selection's file, which deltas and casts derive from."""

    model: str
    version: int
    data: File = field(repr=False)
    selection: SelectionManifest

    def __getattr__(self, name: str) -> Any:
        """`header`, `tensor_xxh3` and `xxh3`, as a store Version has them: its selection file's."""
        return getattr(self.selection, name)


@dataclass(frozen=True)
class Payload:
    """A safetensors file to send, and what it is relative to the version it came from."""

    data: File = field(repr=False)
    xxh3: str
    base_version: int = 0
    dtype: str = ""
    forms: tuple[str, ...] = ()  # the element delta forms the caller decodes (its tensors may use them)
    selection: SelectionManifest | None = None  # the selection's file this payload is or derives from
    base_xxh3: str = ""  # of the base's file (its selection's, with a selection) that a delta is against

    @property
    def byte_size(self) -> int:
        return len(self.data)

    @property
    def parts(self) -> tuple[memoryview, ...]:
        """Its bytes as consecutive views, to send or write without joining them."""
        return self.data.views if isinstance(self.data, Pieces) else (memoryview(self.data).cast("B"),)

    @property
    def held(self) -> int:
        """The bytes it keeps in the cache: a selection's byte ranges are the version's."""
        return self.data.owned if isinstance(self.data, Pieces) else len(self.data)

    def key(self, model: str, version: int) -> PayloadKey:
        selection = self.selection.key if self.selection is not None else ""
        return model, version, self.base_version, self.dtype, "+".join(self.forms), selection


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
        rounded = bits >> 16  # then in place: one temporary per block (each operator would make one)
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        nan = np.isnan(block)
        if nan.any():  # rounding could carry a NaN's payload into infinity: keep it a quiet NaN
            rounded[nan] = ((bits[nan] >> 16) & 0x8000) | 0x7FC0
        out[start : start + block.size] = rounded
    return memoryview(out).cast("B")


def derive(
    data: File,
    header: SafetensorsHeader,
    *,
    keep: Callable[[TensorEntry], bool] | None = None,
    dtype: str = "",
    base: tuple[File, SafetensorsHeader] | None = None,
    forms: tuple[str, ...] = (),
) -> bytes:
    """A new safetensors file with the tensors `keep` selects, float32 ones cast to `dtype`, or each
    written in the smallest of `forms` against the same tensor of `base` (data, header)."""
    bases = {t.name: t for t in base[1].tensors} if base is not None and forms and not dtype else {}

    def one(entry: TensorEntry) -> tuple[str, str, tuple[int, ...], memoryview | bytes, str]:
        raw = tensor_span(data, header, entry)
        if dtype and entry.dtype == "F32":
            return entry.name, dtype, entry.shape, cast_f32(raw, dtype), ""
        was = bases.get(entry.name)
        if was is not None:
            form, raw = deltas.encode(tensor_span(*base, was), raw, DTYPE_SIZES[entry.dtype], forms)
            if form:
                return entry.name, "U8", (len(raw),), raw, form
        return entry.name, entry.dtype, entry.shape, raw, ""

    kept = [entry for entry in header.tensors if keep is None or keep(entry)]
    if bases and sum(e.nbytes for e in kept) >= THREADED_DELTA_BYTES:  # numpy lets go of the GIL: both cores
        with ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="weightserver-delta") as pool:
            built = list(pool.map(one, kept))
    else:
        built = [one(entry) for entry in kept]
    encoded = {name: form for name, _, _, _, form in built if form}
    # Largest elements first keeps every tensor aligned, as in our own encoder.
    selected = sorted((item[:4] for item in built), key=lambda item: (-DTYPE_SIZES[item[1]], item[0]))
    metadata = {ENCODING_KEY: json.dumps(encoded, separators=(",", ":"))} if encoded else None
    prefix, _ = build_header(((n, d, s, len(raw)) for n, d, s, raw in selected), metadata)
    return b"".join([prefix, *(raw for *_, raw in selected)])


def select_file(data: Bytes, header: SafetensorsHeader, cuts: Mapping[str, Cut]) -> tuple[Pieces, SafetensorsHeader]:
    """The selection's file (the proto's Selection) and its header: each tensor named in `cuts` whole
    or cut. A whole tensor, or a cut with only dimensions of size 1 before it, is a byte range of
    `data`, which the file's pieces view (nothing copied); other cuts are gathered, once."""
    import numpy as np  # only servers that select pay for the import

    parts: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []
    for entry in (e for e in header.tensors if e.name in cuts):
        raw = np.frombuffer(tensor_span(data, header, entry), np.uint8)
        dim, low, high = cuts[entry.name] or (0, 0, entry.shape[0] if entry.shape else 1)
        outer = math.prod(entry.shape[:dim])
        row = math.prod(entry.shape[dim + 1 :]) * DTYPE_SIZES[entry.dtype]  # bytes per index along dim
        shape = (*entry.shape[:dim], high - low, *entry.shape[dim + 1 :]) if entry.shape else ()
        rows = raw.reshape(outer, raw.size // outer) if outer > 1 else raw[None, :]  # (a view: nothing copied yet)
        parts.append((entry.name, entry.dtype, shape, rows[:, low * row : high * row]))
    parts.sort(key=lambda item: (-DTYPE_SIZES[item[1]], item[0]))  # as `derive`: every tensor aligned
    prefix, placed = build_header((name, dtype, shape, part.nbytes) for name, dtype, shape, part in parts)
    pieces, owned = [memoryview(prefix)], len(prefix)
    for *_, part in parts:
        if not part.flags.c_contiguous:
            part = np.ascontiguousarray(part)
            owned += part.nbytes
        pieces.append(memoryview(part.reshape(-1)))
    return Pieces(pieces, owned), SafetensorsHeader(tuple(placed), None, len(prefix))


def _any_worth(target, base, forms: tuple[str, ...], unchanged: set[str]) -> bool:
    """Whether an element delta would likely shrink a changed tensor (sampled: see worth_encoding)."""
    was = {t.name: t for t in base.header.tensors}
    for entry in (e for e in target.header.tensors if e.name not in unchanged):
        old, new = tensor_span(base.data, base.header, was[entry.name]), tensor_span(target.data, target.header, entry)
        if deltas.worth_encoding(old, new, DTYPE_SIZES[entry.dtype], forms):
            return True
    return False


class PayloadCache:
    """Builds derived payloads once (concurrent requests wait for the one build) and keeps them
    within `max_bytes`, least recently used dropped first."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[PayloadKey, Payload] = OrderedDict()
        self._building: dict[PayloadKey, threading.Event] = {}
        self.builds = 0  # how many payloads were derived (a cast happens once per version)

    def get(
        self,
        target,
        base=None,
        dtype: str = "",
        forms: tuple[str, ...] = (),
        selection: Resolved | None = None,
        base_selection: Resolved | None = None,
    ) -> Payload:
        """The payload for `target` (a store Version), or for its `selection` (then `base` through
        `base_selection`, the same Selection resolved on it): a delta against `base` (a Version of the
        same model, or None), its changed tensors as element deltas in `forms` where that is smaller
        (not with a cast), and/or a cast to `dtype` (one of CAST_TARGETS: the servicer checks it)."""
        manifest = None
        if selection is not None:
            target = self.selected(target, selection)
            base = self.selected(base, base_selection) if base is not None and base_selection is not None else None
            manifest = target.selection
        # A delta needs the same tensor names, dtypes and shapes, and a tensor that did not change (by digest).
        layout = {(t.name, t.dtype, t.shape) for t in target.header.tensors}
        if base is None or layout != {(t.name, t.dtype, t.shape) for t in base.header.tensors}:
            base, unchanged = None, set()
        else:
            unchanged = {name for name, xxh3 in target.tensor_xxh3.items() if base.tensor_xxh3.get(name) == xxh3}
        worth = base is not None and not dtype and forms and _any_worth(target, base, forms, unchanged)
        forms = tuple(sorted(forms)) if worth else ()
        if not dtype and not unchanged and not forms:
            return Payload(target.data, target.xxh3, selection=manifest)  # no cast; no delta, or every element changed
        based = base.version if base is not None else 0
        key = (target.model, target.version, based, dtype, "+".join(forms), manifest.key if manifest else "")

        def build() -> Payload:
            old = (base.data, base.header) if base is not None else None
            data = derive(
                target.data, target.header, keep=lambda e: e.name not in unchanged, dtype=dtype, base=old, forms=forms
            )
            return Payload(data, xxh3_hex(data), based, dtype, forms, manifest, base.xxh3 if base is not None else "")

        return self._cached(key, build)

    def selected(self, version, selection: Resolved) -> Selected:
        """`version` (a store Version) through `selection`: its selection's file, built once."""
        if not selection.key:  # every tensor whole: the version itself
            manifest = SelectionManifest("", version.byte_size, version.xxh3, version.header, version.tensor_xxh3)
            return Selected(version.model, version.version, version.data, manifest)

        def build() -> Payload:
            data, header = select_file(version.data, version.header, selection.cuts)
            digests = {t.name: xxh3_hex(piece) for t, piece in zip(header.tensors, data.views[1:], strict=True)}
            manifest = SelectionManifest(selection.key, data.nbytes, xxh3_hex(*data.views), header, digests)
            return Payload(data, manifest.xxh3, selection=manifest)

        payload = self._cached((version.model, version.version, 0, "", "", selection.key), build)
        assert payload.selection is not None
        return Selected(version.model, version.version, payload.data, payload.selection)

    def _cached(self, key: PayloadKey, build: Callable[[], Payload]) -> Payload:
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
            payload = build()
            with self._lock:
                self.builds += 1
                self._entries[key] = payload
                total = sum(p.held for p in self._entries.values())
                while total > self.max_bytes and len(self._entries) > 1:
                    total -= self._entries.popitem(last=False)[1].held
            return payload
        finally:
            with self._lock:
                self._building.pop(key).set()

    def keys(self) -> list[PayloadKey]:
        with self._lock:
            return list(self._entries)

    def forget(self, model: str, version: int) -> None:
        """Drop every payload derived from (or against) an evicted version."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == model and version in (k[1], k[2])]:
                del self._entries[key]
