"""Deltas: a version's changed tensors against a base's, whole or as element deltas (a tensor's
changed elements in the smaller of the proto's two ElementDelta forms), and the rebuild from them.

A bf16 cast of fp32 master weights changes a few percent of its elements per optimizer step, so
only element deltas save anything in training. Elements compare as raw bytes (-0.0, NaN payloads
and every dtype alike)."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from weightserver.protocol import framing, page_tables
from weightserver.protocol.digests import PREFIX_BYTES
from weightserver.protocol.errors import IntegrityError, InvalidSafetensors
from weightserver.protocol.framing import Region
from weightserver.protocol.safetensors_format import DTYPE_SIZES, SafetensorsHeader, TensorEntry, parse_header
from weightserver.v1 import weights_pb2 as pb

if TYPE_CHECKING:  # numpy is imported where a delta is built or applied: a server starts without it
    import numpy as np

SPARSE, BITMAP = "sparse", "bitmap"
FORMS = (SPARSE, BITMAP)
WIRE = {SPARSE: pb.ELEMENT_DELTA_SPARSE, BITMAP: pb.ELEMENT_DELTA_BITMAP}  # FetchRequest.element_deltas
BLOCK = 1 << 16  # elements per sparse block: an offset fits a u16
CHUNK = 1 << 22  # elements compared at a time: bounds the temporaries of a large tensor
SAMPLE = 4096  # elements `worth_encoding` compares
WINDOW = 1 << 18  # elements `apply` writes at a time (a multiple of BLOCK and of 8)
ENCODING_KEY = "weightserver.element_delta"  # a delta payload's metadata: JSON {tensor name: form}

Bytes = bytes | bytearray | memoryview


def _words(data: Bytes, itemsize: int) -> np.ndarray:
    import numpy as np

    return np.frombuffer(data, dtype=f"<u{itemsize}")


def sizes(n: int, k: int, itemsize: int) -> dict[str, int]:
    """Bytes of each form for `k` of `n` elements changed ("" is the whole tensor)."""
    return {"": n * itemsize, SPARSE: 4 * -(-n // BLOCK) + (2 + itemsize) * k, BITMAP: -(-n // 8) + itemsize * k}


def worth_encoding(base: Bytes, new: Bytes, itemsize: int, forms: tuple[str, ...] = FORMS) -> bool:
    """Whether a sample says a form could save a fifth of the tensor, so one changed everywhere (fp32
    after an optimizer step) is not compared in full; one the sample covers whole takes any saving."""
    import numpy as np

    old, now = _words(base, itemsize), _words(new, itemsize)
    step = max(1, now.size // SAMPLE)
    sample = int(np.count_nonzero(old[::step] != now[::step])) if now.size else 0
    estimate = sample * now.size // max(1, -(-now.size // step))
    cost = sizes(now.size, estimate, itemsize)
    margin = 1.0 if step == 1 else 0.8  # (an estimate from a sample needs a fifth to be worth a full compare)
    return any(cost[f] < margin * cost[""] for f in forms)


def encode(base: Bytes, new: Bytes, itemsize: int, forms: tuple[str, ...] = FORMS) -> tuple[str, Bytes]:
    """(form, bytes) of `new` against `base` (same length): ("", new) when the whole tensor is smallest."""
    import numpy as np

    if len(base) != len(new) or len(new) % itemsize:
        raise ValueError(f"base and new must be the same whole number of {itemsize}-byte elements")
    if not worth_encoding(base, new, itemsize, forms):
        return "", new
    old, now, n = _words(base, itemsize), _words(new, itemsize), len(new) // itemsize
    parts = [np.flatnonzero(old[i : i + CHUNK] != now[i : i + CHUNK]) + i for i in range(0, n, CHUNK)]
    index = np.concatenate(parts)  # the changed elements, ascending (n > 0: worth_encoding declines 0)
    cost = {form: size for form, size in sizes(n, index.size, itemsize).items() if not form or form in forms}
    form = min(cost, key=lambda f: (cost[f], f != ""))
    if not form:
        return "", new
    values = now[index].tobytes()
    if form == SPARSE:
        counts = np.bincount(index >> 16, minlength=-(-n // BLOCK)).astype("<u4")
        return form, b"".join([counts.tobytes(), (index & (BLOCK - 1)).astype("<u2").tobytes(), values])
    mask = np.zeros(n, dtype=bool)
    mask[index] = True
    return form, np.packbits(mask, bitorder="little").tobytes() + values


def apply(form: str, delta: Bytes, out: memoryview, itemsize: int, what: str = "tensor") -> int:
    """Write `delta`'s elements into `out` (the base tensor's bytes), WINDOW at a time so temporaries
    stay a few MiB: how many changed. Malformed input: IntegrityError naming `what`, nothing written."""
    import numpy as np

    n, delta, words = len(out) // itemsize, memoryview(delta).cast("B"), _words(out, itemsize)
    if form == SPARSE:
        blocks = -(-n // BLOCK)
        rest = len(delta) - 4 * blocks
        if rest < 0 or rest % (2 + itemsize):
            raise IntegrityError(f"{what}: a sparse delta of {len(delta)} bytes is truncated or padded")
        k = rest // (2 + itemsize)
        counts = np.frombuffer(delta, dtype="<u4", count=blocks)
        ends = np.cumsum(counts, dtype=np.int64)  # where each block's elements end
        if (int(ends[-1]) if blocks else 0) != k:
            raise IntegrityError(f"{what}: a sparse delta's block counts sum to {counts.sum()}, not its {k} elements")
        offsets = np.frombuffer(delta, dtype="<u2", count=k, offset=4 * blocks)
        values = np.frombuffer(delta, dtype=f"<u{itemsize}", count=k, offset=4 * blocks + 2 * k)
        last = offsets[k - int(counts[-1]) :] if blocks else offsets[:0]  # only the last block can pass n
        if last.size and (top := (blocks - 1) * BLOCK + int(last.max())) >= n:
            raise IntegrityError(f"{what}: a delta names element {top} of a tensor of {n}")
        step = WINDOW // BLOCK
        for first in range(0, blocks, step):
            stop = min(first + step, blocks)
            lo, hi = int(ends[first - 1]) if first else 0, int(ends[stop - 1])
            starts = np.arange(first, stop, dtype=np.int64) * BLOCK
            words[np.repeat(starts, counts[first:stop]) + offsets[lo:hi]] = values[lo:hi]
        return k
    if form == BITMAP:
        bitmap = -(-n // 8)
        if len(delta) < bitmap:
            raise IntegrityError(f"{what}: a bitmap delta of {len(delta)} bytes is shorter than its {bitmap}-byte map")
        bits = np.frombuffer(delta, dtype=np.uint8, count=bitmap)
        if n % 8 and int(bits[-1]) >> (n % 8):
            raise IntegrityError(f"{what}: a bitmap delta marks elements past the tensor's {n}")
        k = int(np.bitwise_count(bits).sum(dtype=np.int64))
        if (carried := len(delta) - bitmap) != k * itemsize:
            raise IntegrityError(f"{what}: a bitmap delta marks {k} elements but carries {carried} bytes")
        values, done = np.frombuffer(delta, dtype=f"<u{itemsize}", offset=bitmap), 0
        for start in range(0, n, WINDOW):
            index = np.flatnonzero(np.unpackbits(bits[start // 8 : (start + WINDOW) // 8], bitorder="little"))
            index += start
            words[index] = values[done : done + index.size]
            done += index.size
        return k
    raise IntegrityError(f"{what}: unknown element delta form {form!r}; known: {', '.join(FORMS)}")


class Rebuild(framing.Regions):
    """A framing.Sink that rebuilds a version in `rebuilt` (the base's file) as its delta arrives: a
    whole tensor lands in place, an element delta is held and applied once in; no buffer, no second
    pass. `xxh3()` is the payload's digest, `changed` its tensors. A malformed payload sets `problem`
    (`rebuilt` is spoilt) and the rest is only hashed, to tell a bad transfer from a bad delta."""

    def __init__(self, rebuilt: memoryview, base_header: SafetensorsHeader, nbytes: int) -> None:
        self.rebuilt, self.problem = rebuilt, ""
        self.changed: list[str] = []
        self.forms: dict[str, str] = {}  # the changed tensors that came as element deltas, and their forms
        self._base, self._hasher = base_header, xxhash.xxh3_128()
        super().__init__(nbytes, Region(min(nbytes, PREFIX_BYTES), then=self._check_prefix))

    @classmethod
    def on(
        cls,
        base: Bytes,
        base_header: SafetensorsHeader,
        layout: Sequence[TensorEntry],
        byte_size: int,
        nbytes: int,
        *,
        in_place: bool = False,
    ) -> Rebuild | None:
        """The rebuild of the version laid out as `layout` in `byte_size` bytes from an `nbytes` delta
        on `base` (in `base` itself with `in_place`, else in a copy); None if `base` is laid out otherwise."""
        if len(base) != byte_size or [_placement(t) for t in base_header.tensors] != [_placement(t) for t in layout]:
            return None
        rebuilt = memoryview(base).cast("B")
        if not in_place:  # a copy into fresh pages (160 ms at 256 MiB; bytearray 290)
            rebuilt = page_tables.anonymous(byte_size)
            rebuilt[:] = memoryview(base).cast("B")
        return cls(rebuilt, base_header, nbytes)

    def xxh3(self) -> str:
        return self._hasher.hexdigest()

    def _push(self, region: Region) -> None:
        super()._push(region._replace(hasher=self._hasher))  # the payload's digest: every byte

    def _fail(self, problem: str) -> None:
        """The rest of the payload only hashed."""
        self.problem, self._held, self._filled = problem, None, 0
        self._regions.clear()
        self._push(Region(self.nbytes - self._received))

    def _check_prefix(self, prefix: memoryview) -> None:
        try:
            parse_header(prefix, self.nbytes)
        except InvalidSafetensors as exc:
            return self._fail(f"the delta is not a valid safetensors file: {exc}")
        except ValueError:  # (the header itself is still to come)
            pass
        self._push(Region(int.from_bytes(prefix, "little"), then=lambda header: self._plan(bytes(prefix) + header)))

    def _plan(self, head: bytes) -> None:
        """The header is in: each of its tensors a region, whole into its place or held to apply."""
        try:
            changed = parse_header(head, self.nbytes)
            encoded = json.loads((changed.metadata or {}).get(ENCODING_KEY, "{}"))
        except (InvalidSafetensors, ValueError) as exc:
            return self._fail(f"the delta is not a valid safetensors file: {exc}")
        if not isinstance(encoded, dict):
            return self._fail(f"the delta's {ENCODING_KEY!r} metadata is not a JSON object")
        places = {t.name: t for t in self._base.tensors}
        for entry in changed.tensors:  # (in file order, tiling the rest of the payload)
            place, what = places.get(entry.name), f"tensor {entry.name!r} of the delta"
            if place is None:
                return self._fail(f"{what} is not in the version")
            given, expected = f"{entry.dtype}{list(entry.shape)}", f"{place.dtype}{list(place.shape)}"
            start = self._base.data_start + place.begin
            out = self.rebuilt[start : start + place.nbytes]
            if entry.name in encoded:
                if entry.dtype != "U8" or len(entry.shape) != 1:
                    return self._fail(f"{what} is an element delta, so U8 of one dimension, not {given}")
                self.forms[entry.name] = form = encoded[entry.name]
                write = functools.partial(self._apply, form, out, DTYPE_SIZES[place.dtype], what)
                self._push(Region(entry.nbytes, then=write))
            elif given != expected:
                return self._fail(f"{what} is {given}; the version's is {expected}")
            else:
                self._push(Region(entry.nbytes, into=out))
            self.changed.append(entry.name)

    def _apply(self, form: str, out: memoryview, itemsize: int, what: str, delta: memoryview) -> None:
        try:
            apply(form, delta, out, itemsize, what)
        except IntegrityError as exc:
            self._fail(str(exc))


def apply_delta(
    base: Bytes,
    base_header: SafetensorsHeader,
    layout: Sequence[TensorEntry],
    byte_size: int,
    delta: Bytes,
    *,
    in_place: bool = False,
) -> tuple[memoryview, list[str]] | None:
    """The inverse of payloads.derive(..., keep=changed): the base (itself with `in_place`) with `delta`'s
    tensors written over, and their names; None when the target (`layout`, `byte_size`) is laid out
    otherwise. A malformed delta: IntegrityError (in place, the base is spoilt). The caller checks digests."""
    rebuild = Rebuild.on(base, base_header, layout, byte_size, len(delta), in_place=in_place)
    if rebuild is None:
        return None
    framing.receive_chunks([memoryview(delta).cast("B")], rebuild)
    if rebuild.problem:
        raise IntegrityError(rebuild.problem)
    return rebuild.rebuilt, rebuild.changed


def _placement(entry: TensorEntry) -> tuple[str, str, tuple[int, ...], int, int]:
    return entry.name, entry.dtype, tuple(entry.shape), entry.begin, entry.end
