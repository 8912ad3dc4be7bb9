"""The safetensors format without torch: an 8-byte little-endian header length N, N bytes of JSON
mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (into the data
section; plus an optional ``"__metadata__"`` map of strings), then the data section."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from weightserver.protocol.errors import InvalidSafetensors, clipped_repr

# dtype name -> bytes per element, as the safetensors specification names them.
_DTYPES = {1: "BOOL U8 I8 F8_E5M2 F8_E4M3", 2: "I16 U16 F16 BF16", 4: "I32 U32 F32", 8: "I64 U64 F64"}
DTYPE_SIZES: dict[str, int] = {name: size for size, names in _DTYPES.items() for name in names.split()}

METADATA_KEY = "__metadata__"
# The format's own limits (the safetensors package's); publishes have tighter ones (PUBLISH_MAX_*).
DEFAULT_MAX_HEADER_BYTES = 100 * 1024 * 1024
DEFAULT_MAX_TENSORS = 1_000_000


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes lie in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed and validated header. `data_start` is the file offset of the data section."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None
    data_start: int

    def __len__(self) -> int:
        return len(self.tensors)


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise InvalidSafetensors(f"header names tensor {clipped_repr(key)} twice; tensor names must be unique")
        result[key] = value
    return result


def parse_header(
    data: bytes | bytearray | memoryview,
    total_size: int | None = None,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
) -> SafetensorsHeader:
    """Parse and validate the header at the start of `data`, of a `total_size`-byte file (default: all)."""
    view = memoryview(data)
    size = len(view) if total_size is None else total_size
    if size < 8 or len(view) < 8:
        raise InvalidSafetensors(f"file is {size} bytes; a safetensors file starts with an 8-byte header length")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > max_header_bytes:
        raise InvalidSafetensors(f"header is {header_len} bytes, over the limit of {max_header_bytes}")
    if 8 + header_len > size:
        raise InvalidSafetensors(f"header length {header_len} runs past the end of the {size}-byte file")
    if len(view) < 8 + header_len:
        raise ValueError("parse_header needs the whole header in `data`")
    try:
        obj = json.loads(bytes(view[8 : 8 + header_len]).decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except UnicodeDecodeError as exc:
        raise InvalidSafetensors(f"header is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, over-long ints, deep nesting
        raise InvalidSafetensors(f"header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidSafetensors(f"header must be a JSON object, got {type(obj).__name__}")
    metadata = obj.pop(METADATA_KEY, None)
    if len(obj) > max_tensors:
        raise InvalidSafetensors(f"header lists {len(obj)} tensors, over the limit of {max_tensors} tensors")

    # (JSON's keys are strings)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise InvalidSafetensors(f"{METADATA_KEY!r} must map strings to strings")

    entries = sorted((_parse_entry(name, spec) for name, spec in obj.items()), key=lambda e: (e.begin, e.end))
    _check_layout(entries, size - 8 - header_len)
    return SafetensorsHeader(tuple(entries), metadata, 8 + header_len)


def _parse_entry(name: str, spec: object) -> TensorEntry:
    if not name:
        raise InvalidSafetensors("header has a tensor with an empty name")
    tensor = f"tensor {clipped_repr(name)}"
    if not isinstance(spec, dict):
        raise InvalidSafetensors(f"{tensor}: expected an object with dtype, shape, data_offsets")
    if missing := {"dtype", "shape", "data_offsets"} - spec.keys():
        raise InvalidSafetensors(f"{tensor}: missing {', '.join(sorted(missing))}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise InvalidSafetensors(f"{tensor}: unknown dtype {clipped_repr(dtype)}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise InvalidSafetensors(f"{tensor}: shape must be a list of non-negative integers, got {clipped_repr(shape)}")
    if math.prod(d for d in shape if d) >= 2**63:  # (an empty tensor's other dims, which no byte count bounds)
        raise InvalidSafetensors(f"{tensor}: shape {clipped_repr(shape)} spans 2^63 elements or more; no tensor can")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise InvalidSafetensors(f"{tensor}: data_offsets must be [begin, end], got {clipped_repr(offsets)}")
    begin, end = offsets
    if end < begin:
        raise InvalidSafetensors(f"{tensor}: data_offsets end {end} is before begin {begin}")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise InvalidSafetensors(
            f"{tensor}: shape {clipped_repr(shape)} of {dtype} needs {expected} bytes "
            f"but data_offsets [{begin}, {end}] span {end - begin}"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(entries: list[TensorEntry], data_len: int) -> None:
    """Tensors (sorted by offset) must tile the data section exactly: in bounds, no overlap, no gap, no tail."""
    position = 0
    for entry in entries:
        if entry.end > data_len or entry.begin != position:
            offsets = f"tensor {clipped_repr(entry.name)}: data_offsets [{entry.begin}, {entry.end}]"
            if entry.end > data_len:
                raise InvalidSafetensors(f"{offsets} run past the {data_len}-byte data section")
            if entry.begin < position:
                raise InvalidSafetensors(f"{offsets} overlap the previous tensor, which ends at {position}")
            raise InvalidSafetensors(
                f"tensor {clipped_repr(entry.name)}: gap of {entry.begin - position} bytes before its data "
                f"(offset {position}); tensors must be packed"
            )
        position = entry.end
    if position != data_len:
        raise InvalidSafetensors(f"data section is {data_len} bytes but the tensors cover {position}: trailing bytes")


def build_header(
    entries: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """The length prefix and JSON header framing `entries` ``(name, dtype, shape, nbytes)``, and the
    placed entries. Padded to 8 bytes, as the safetensors package does, so 8-byte dtypes stay aligned."""
    header: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    placed = []
    position = 0
    for name, dtype, shape, nbytes in entries:
        if dtype not in DTYPE_SIZES:
            raise InvalidSafetensors(f"tensor {clipped_repr(name)}: unknown dtype {clipped_repr(dtype)}")
        if name in header or name == METADATA_KEY:
            raise InvalidSafetensors(f"tensor name {clipped_repr(name)} appears twice or is reserved")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + nbytes]}
        placed.append(TensorEntry(name, dtype, tuple(shape), position, position + nbytes))
        position += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-(8 + len(encoded)) % 8)
    return len(encoded).to_bytes(8, "little") + encoded, placed
