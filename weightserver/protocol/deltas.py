"""Deltas: a version's changed tensors against a base version's, whole or as element deltas (one
tensor's changed elements, in the smaller of two forms), and the rebuild of the version from them.

A bf16 cast of fp32 master weights changes in a few percent of its elements per optimizer step,
so a delta that carries whole changed tensors saves nothing in training; one that carries the
changed elements does. Elements are compared as raw bytes (so -0.0, NaN payloads and every
dtype alike). The proto's ElementDelta lays out the two forms byte for byte (little-endian):
``sparse``, u32 counts of changed elements per block of 65,536, their u16 offsets in the block,
their new bytes; ``bitmap``, a bit per element (least significant first), the changed ones' new
bytes. `encode` picks the smallest of these and the whole tensor (ties go to the whole tensor),
from the count of changed elements alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from weightserver.protocol.errors import IntegrityError, InvalidSafetensors
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
_WORDS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
ENCODING_KEY = "weightserver.element_delta"  # a delta payload's metadata: JSON {tensor name: form}

Bytes = bytes | bytearray | memoryview


def _words(data: Bytes, itemsize: int) -> np.ndarray:
    import numpy as np

    return np.frombuffer(data, dtype=_WORDS[itemsize])


def sizes(n: int, k: int, itemsize: int) -> dict[str, int]:
    """Bytes of each form for `k` of `n` elements changed ("" is the whole tensor)."""
    return {"": n * itemsize, SPARSE: 4 * -(-n // BLOCK) + (2 + itemsize) * k, BITMAP: -(-n // 8) + itemsize * k}


def worth_encoding(base: Bytes, new: Bytes, itemsize: int, forms: tuple[str, ...] = FORMS) -> bool:
    """Whether a sample of the elements says a form could save a fifth of the whole tensor: a tensor
    that changed everywhere (fp32 weights after an optimizer step) is not compared in full. A tensor
    the sample covers whole (under 2 x SAMPLE elements) takes any saving (the demo's DDPG actor: 13%)."""
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
    """Write `delta`'s elements into `out` (the base tensor's bytes, writable): how many changed.
    Malformed input raises IntegrityError naming `what` and writes nothing. The elements are
    written WINDOW at a time, so the temporaries stay a few MiB whatever the tensor's size."""
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
        values = np.frombuffer(delta, dtype=_WORDS[itemsize], count=k, offset=4 * blocks + 2 * k)
        last = offsets[k - int(counts[-1]) :] if blocks else offsets[:0]  # only the last block can pass n
        if last.size and (blocks - 1) * BLOCK + int(last.max()) >= n:
            raise IntegrityError(
                f"{what}: a delta names element {(blocks - 1) * BLOCK + int(last.max())} of a tensor of {n}"
            )
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
        if len(delta) - bitmap != k * itemsize:
            carried = len(delta) - bitmap
            raise IntegrityError(f"{what}: a bitmap delta marks {k} elements but carries {carried} bytes")
        values, done = np.frombuffer(delta, dtype=_WORDS[itemsize], offset=bitmap), 0
        for start in range(0, n, WINDOW):
            index = np.flatnonzero(np.unpackbits(bits[start // 8 : (start + WINDOW) // 8], bitorder="little"))
            index += start
            words[index] = values[done : done + index.size]
            done += index.size
        return k
    raise IntegrityError(f"{what}: unknown element delta form {form!r}; known: {', '.join(FORMS)}")


def apply_delta(
    base: Bytes,
    base_header: SafetensorsHeader,
    layout: Sequence[TensorEntry],
    byte_size: int,
    delta: Bytes,
    *,
    in_place: bool = False,
) -> tuple[memoryview, list[str]] | None:
    """The inverse of `derive(..., keep=changed)`: the base with `delta`'s tensors written over (into
    `base` itself with `in_place`), and their names; None when the target (`layout`, `byte_size`) is
    laid out otherwise. A malformed delta raises IntegrityError (in place: the base is then spoilt).
    The caller checks the digests."""
    if len(base) != byte_size or [_placement(t) for t in base_header.tensors] != [_placement(t) for t in layout]:
        return None
    try:
        changed = parse_header(delta)
        encoded = json.loads((changed.metadata or {}).get(ENCODING_KEY, "{}"))
    except (InvalidSafetensors, ValueError) as exc:
        raise IntegrityError(f"the delta is not a valid safetensors file: {exc}") from None
    if not isinstance(encoded, dict):
        raise IntegrityError(f"the delta's {ENCODING_KEY!r} metadata is not a JSON object")
    places = {t.name: t for t in base_header.tensors}
    rebuilt, source = memoryview(base if in_place else bytearray(base)), memoryview(delta)
    for entry in changed.tensors:
        place, what = places.get(entry.name), f"tensor {entry.name!r} of the delta"
        if place is None:
            raise IntegrityError(f"{what} is not in the version")
        given, expected = f"{entry.dtype}{list(entry.shape)}", f"{place.dtype}{list(place.shape)}"
        start, bytes_ = base_header.data_start + place.begin, source[changed.data_start + entry.begin :][: entry.nbytes]
        if entry.name in encoded:
            if entry.dtype != "U8" or len(entry.shape) != 1:
                raise IntegrityError(f"{what} is an element delta, so U8 of one dimension, not {given}")
            size = DTYPE_SIZES[place.dtype]
            apply(encoded[entry.name], bytes_, rebuilt[start : start + place.nbytes], size, what)
        elif given != expected:
            raise IntegrityError(f"{what} is {given}; the version's is {expected}")
        else:
            rebuilt[start : start + place.nbytes] = bytes_
    return rebuilt, [t.name for t in changed.tensors]


def _placement(entry: TensorEntry) -> tuple[str, str, tuple[int, ...], int, int]:
    return entry.name, entry.dtype, tuple(entry.shape), entry.begin, entry.end
