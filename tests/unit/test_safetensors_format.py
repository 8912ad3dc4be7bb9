"""Tests of the torch-free safetensors header parser and builder.

Golden bytes pin the exact framing; the real `safetensors` package cross-checks both directions;
one test per validation rule checks the error type and that the message names the problem;
hypothesis checks round trips and that arbitrary or mutated bytes never escape as anything but
`InvalidSafetensors`.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightserver.protocol.errors import InvalidRequest, InvalidSafetensors
from weightserver.protocol.safetensors_format import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_TENSORS,
    DTYPE_SIZES,
    METADATA_KEY,
    SafetensorsHeader,
    TensorEntry,
    build_header,
    parse_header,
)

# ---------------------------------------------------------------------------- helpers


def frame(header: str | bytes | dict | list | int | None, data: bytes = b"", *, pad: bool = True) -> bytes:
    """A file made of an 8-byte LE length, `header` (JSON-encoded unless str/bytes) and `data`."""
    if isinstance(header, bytes):
        raw = header
    elif isinstance(header, str):
        raw = header.encode("utf-8")
    else:
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def spec(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def build_file(tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None) -> bytes:
    prefix, _ = build_header(
        [(name, dtype, shape, len(raw)) for name, (dtype, shape, raw) in tensors.items()], metadata
    )
    return prefix + b"".join(raw for _, _, raw in tensors.values())


def torch_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_invalid(data: bytes, *fragments: str, **limits: int) -> InvalidSafetensors:
    """parse_header(data) raises InvalidSafetensors whose message contains every fragment."""
    with pytest.raises(InvalidSafetensors) as info:
        parse_header(data, **limits)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


def assert_tiles(header: SafetensorsHeader, data: bytes) -> None:
    """The parsed entries of the whole file `data` are sane and cover its data section exactly,
    in order, without gaps or trailing bytes."""
    (header_len,) = struct.unpack_from("<Q", data)
    assert header.data_start == 8 + header_len
    position = 0
    names = set()
    for entry in header.tensors:
        assert entry.name and entry.name not in names
        names.add(entry.name)
        assert entry.dtype in DTYPE_SIZES
        assert all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry.shape)
        assert entry.begin == position
        assert entry.nbytes == math.prod(entry.shape) * DTYPE_SIZES[entry.dtype]
        position = entry.end
    assert header.data_start + position == len(data)
    if header.metadata is not None:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())


F32_2 = spec("F32", [2], 0, 8)

# ---------------------------------------------------------------------------- golden bytes


def test_golden_single_tensor() -> None:
    prefix, placed = build_header([("w", "F32", (2,), 8)])
    body = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    assert len(body) == 54
    assert prefix == b"\x38\x00\x00\x00\x00\x00\x00\x00" + body + b"  "
    assert placed == [TensorEntry("w", "F32", (2,), 0, 8)]


def test_golden_metadata_and_two_tensors() -> None:
    prefix, placed = build_header([("w", "F32", (2,), 8), ("b", "U8", (3,), 3)], {"step": "7"})
    body = (
        b'{"__metadata__":{"step":"7"},'
        b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}'
    )
    assert len(body) == 135
    assert prefix == b"\x88\x00\x00\x00\x00\x00\x00\x00" + body + b" "
    assert placed == [TensorEntry("w", "F32", (2,), 0, 8), TensorEntry("b", "U8", (3,), 8, 11)]


def test_golden_scalar_empty_and_bf16() -> None:
    prefix, placed = build_header([("scalar", "F64", (), 8), ("empty", "I32", (0, 4), 0), ("m", "BF16", (2, 3), 12)])
    body = (
        b'{"scalar":{"dtype":"F64","shape":[],"data_offsets":[0,8]},'
        b'"empty":{"dtype":"I32","shape":[0,4],"data_offsets":[8,8]},'
        b'"m":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]}}'
    )
    assert len(body) == 174
    assert prefix == b"\xb0\x00\x00\x00\x00\x00\x00\x00" + body + b"  "
    assert [(e.name, e.begin, e.end) for e in placed] == [("scalar", 0, 8), ("empty", 8, 8), ("m", 8, 20)]


def test_golden_zero_tensors() -> None:
    prefix, placed = build_header([])
    assert prefix == b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    assert placed == []
    # An empty metadata map is not written at all.
    assert build_header([], {})[0] == prefix


def test_golden_non_ascii_name_is_escaped_and_round_trips() -> None:
    prefix, _ = build_header([("caf\u00e9", "U8", (1,), 1)])
    body = b'{"caf\\u00e9":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert prefix == b"\x40\x00\x00\x00\x00\x00\x00\x00" + body + b"   "
    header = parse_header(prefix + b"\x07")
    assert header.tensors == (TensorEntry("caf\u00e9", "U8", (1,), 0, 1),)


@pytest.mark.parametrize("name_len", range(1, 17))
def test_build_header_pads_with_spaces_to_a_multiple_of_eight(name_len: int) -> None:
    prefix, _ = build_header([("n" * name_len, "U8", (1,), 1)])
    assert len(prefix) % 8 == 0
    (header_len,) = struct.unpack_from("<Q", prefix)
    assert header_len == len(prefix) - 8
    text = prefix[8:].decode("utf-8")
    stripped = text.rstrip(" ")
    assert stripped.endswith("}")
    assert len(text) - len(stripped) < 8
    assert json.loads(stripped) == {"n" * name_len: spec("U8", [1], 0, 1)}


def test_build_header_rejects_unknown_dtype_and_duplicate_names() -> None:
    with pytest.raises(InvalidSafetensors, match=r"'w'.*'F128'"):
        build_header([("w", "F128", (1,), 16)])
    with pytest.raises(InvalidSafetensors, match=r"'w'.*twice"):
        build_header([("w", "U8", (1,), 1), ("w", "U8", (1,), 1)])


def test_build_header_rejects_the_metadata_key_as_a_tensor_name() -> None:
    # A tensor called "__metadata__" would produce a file parse_header (and safetensors) reject.
    with pytest.raises(InvalidSafetensors, match="__metadata__"):
        build_header([(METADATA_KEY, "U8", (1,), 1)])
    with pytest.raises(InvalidSafetensors, match="__metadata__"):
        build_header([(METADATA_KEY, "U8", (1,), 1)], {"a": "b"})


def test_invalid_safetensors_is_an_invalid_request() -> None:
    assert issubclass(InvalidSafetensors, InvalidRequest)


# ---------------------------------------------------------------------------- cross-check with `safetensors`


def test_numpy_saved_file_parses() -> None:
    arrays = {
        "b": np.arange(3, dtype=np.int64),
        "a": np.arange(4, dtype=np.float32).reshape(2, 2),
        "z": np.zeros((0,), np.float16),
        "s": np.array(5, np.uint8),
        "flags": np.array([True, False, True]),
        "u16": np.arange(5, dtype=np.uint16),
        "i8": np.arange(-3, 3, dtype=np.int8).reshape(2, 3),
        "f64": np.linspace(0, 1, 7),
        "i32": np.arange(6, dtype=np.int32).reshape(1, 2, 3),
        "u32": np.arange(2, dtype=np.uint32),
        "u64": np.arange(2, dtype=np.uint64),
        "i16": np.arange(2, dtype=np.int16),
    }
    data = safetensors.numpy.save(arrays, metadata={"k": "v", "step": "12"})
    header = parse_header(data)
    assert_tiles(header, data)
    assert header.metadata == {"k": "v", "step": "12"}

    (header_len,) = struct.unpack_from("<Q", data)
    assert header.data_start == 8 + header_len
    raw = json.loads(data[8 : 8 + header_len])
    raw.pop(METADATA_KEY)
    assert {e.name for e in header.tensors} == set(arrays)
    expected_dtype = {
        np.dtype(np.int64): "I64",
        np.dtype(np.float32): "F32",
        np.dtype(np.float16): "F16",
        np.dtype(np.uint8): "U8",
        np.dtype(np.bool_): "BOOL",
        np.dtype(np.uint16): "U16",
        np.dtype(np.int8): "I8",
        np.dtype(np.float64): "F64",
        np.dtype(np.int32): "I32",
        np.dtype(np.uint32): "U32",
        np.dtype(np.uint64): "U64",
        np.dtype(np.int16): "I16",
    }
    for entry in header.tensors:
        array = arrays[entry.name]
        assert raw[entry.name] == spec(entry.dtype, list(entry.shape), entry.begin, entry.end)
        assert entry.dtype == expected_dtype[array.dtype]
        assert entry.shape == array.shape
        start = header.data_start
        assert data[start + entry.begin : start + entry.end] == array.tobytes()
    # The data section starts 8-byte aligned, as both writers pad the header.
    assert header.data_start % 8 == 0


def test_torch_saved_file_parses_including_bf16_bool_and_fp8() -> None:
    tensors = {
        "bf": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "h": torch.ones(3, dtype=torch.float16),
        "mask": torch.tensor([True, False]),
        "e4m3": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "e5m2": torch.zeros(2, dtype=torch.float8_e5m2),
        "l": torch.arange(3, dtype=torch.int64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
    }
    names = {
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
        torch.int64: "I64",
        torch.float32: "F32",
    }
    data = safetensors.torch.save(tensors)
    header = parse_header(data)
    assert_tiles(header, data)
    assert header.metadata is None
    by_name = {e.name: e for e in header.tensors}
    assert set(by_name) == set(tensors)
    for name, tensor in tensors.items():
        entry = by_name[name]
        assert entry.dtype == names[tensor.dtype]
        assert entry.shape == tuple(tensor.shape)
        raw = data[header.data_start + entry.begin : header.data_start + entry.end]
        assert raw == torch_bytes(tensor)


def test_empty_safetensors_file_parses() -> None:
    data = safetensors.numpy.save({})
    header = parse_header(data)
    assert header.tensors == ()
    assert len(header) == 0
    assert header.data_start == len(data)


def test_build_header_matches_safetensors_byte_for_byte() -> None:
    # safetensors writes tensors ordered by dtype alignment (largest first), then by name.
    arrays = {
        "b": np.arange(3, dtype=np.int64),
        "a": np.arange(4, dtype=np.float32).reshape(2, 2),
        "z": np.zeros((0,), np.float16),
        "s": np.array(5, np.uint8),
    }
    reference = safetensors.numpy.save(arrays, metadata={"k": "v"})
    ordered = ["b", "a", "z", "s"]
    ours = build_file(
        {
            name: (
                {"int64": "I64", "float32": "F32", "float16": "F16", "uint8": "U8"}[str(arrays[name].dtype)],
                arrays[name].shape,
                arrays[name].tobytes(),
            )
            for name in ordered
        },
        {"k": "v"},
    )
    assert ours == reference


def test_our_files_load_with_safetensors_numpy(tmp_path) -> None:
    arrays = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "idx": np.arange(5, dtype=np.int64),
        "flag": np.array([True, False]),
        "scalar": np.array(2.5, np.float64),
        "empty": np.zeros((0, 2), np.int32),
        "half": np.ones(3, np.float16),
        "u8": np.arange(7, dtype=np.uint8),
    }
    np_to_st = {
        "float32": "F32",
        "int64": "I64",
        "bool": "BOOL",
        "float64": "F64",
        "int32": "I32",
        "float16": "F16",
        "uint8": "U8",
    }
    data = build_file({n: (np_to_st[str(a.dtype)], a.shape, a.tobytes()) for n, a in arrays.items()}, {"step": "3"})
    loaded = safetensors.numpy.load(data)
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype
        assert loaded[name].shape == array.shape
        np.testing.assert_array_equal(loaded[name], array)
    path = tmp_path / "ours.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"step": "3"}
        assert set(f.keys()) == set(arrays)


def test_our_files_load_with_safetensors_torch() -> None:
    tensors = {
        "bf": torch.randn(4, 3).to(torch.bfloat16),
        "f32": torch.randn(2, 2),
        "mask": torch.tensor([True, False, True]),
        "e4m3": torch.randn(5).to(torch.float8_e4m3fn),
        "i16": torch.arange(4, dtype=torch.int16),
        "scalar": torch.tensor(7, dtype=torch.int32),
    }
    names = {
        torch.bfloat16: "BF16",
        torch.float32: "F32",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.int16: "I16",
        torch.int32: "I32",
    }
    data = build_file({n: (names[t.dtype], tuple(t.shape), torch_bytes(t)) for n, t in tensors.items()})
    loaded = safetensors.torch.load(data)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert loaded[name].shape == tensor.shape
        assert torch_bytes(loaded[name]) == torch_bytes(tensor)


def test_our_zero_tensor_file_loads_with_safetensors() -> None:
    prefix, _ = build_header([])
    assert safetensors.numpy.load(prefix) == {}


# ---------------------------------------------------------------------------- accepted inputs


def test_parse_returns_entries_sorted_by_offset_with_metadata() -> None:
    data = frame(
        {"second": spec("U8", [2], 4, 6), METADATA_KEY: {"a": "1"}, "first": spec("I32", [1], 0, 4)},
        b"\x00" * 6,
    )
    header = parse_header(data)
    assert header.tensors == (
        TensorEntry("first", "I32", (1,), 0, 4),
        TensorEntry("second", "U8", (2,), 4, 6),
    )
    assert header.tensors[1].nbytes == 2
    assert header.metadata == {"a": "1"}
    assert len(header) == 2


def test_empty_tensors_are_accepted() -> None:
    data = frame(
        {
            "e1": spec("F32", [0], 0, 0),
            "w": spec("U8", [4], 0, 4),
            "e2": spec("F64", [3, 0, 2], 4, 4),
            "e3": spec("I16", [0], 4, 4),
        },
        b"abcd",
    )
    header = parse_header(data)
    assert_tiles(header, data)
    assert {e.name: e.shape for e in header.tensors} == {"e1": (0,), "w": (4,), "e2": (3, 0, 2), "e3": (0,)}


def test_scalar_tensors_are_accepted() -> None:
    data = frame({"s": spec("F64", [], 0, 8), "b": spec("BOOL", [], 8, 9)}, b"\x00" * 9)
    header = parse_header(data)
    assert [(e.name, e.shape, e.nbytes) for e in header.tensors] == [("s", (), 8), ("b", (), 1)]


@pytest.mark.parametrize("header", ["{}", "{}      ", {METADATA_KEY: {}}, {METADATA_KEY: {"k": "v"}}])
def test_zero_tensor_files_are_accepted(header) -> None:
    data = frame(header)
    parsed = parse_header(data)
    assert parsed.tensors == ()
    assert parsed.data_start == len(data)


def test_unpadded_and_whitespace_headers_are_accepted() -> None:
    data = frame('  {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}\n\t', b"x", pad=False)
    assert parse_header(data).tensors == (TensorEntry("w", "U8", (1,), 0, 1),)


def test_every_dtype_is_accepted_with_its_size() -> None:
    tensors = {f"t_{dtype}": (dtype, (3,), bytes(3 * size)) for dtype, size in DTYPE_SIZES.items()}
    data = build_file(tensors)
    header = parse_header(data)
    assert {e.name: (e.dtype, e.nbytes) for e in header.tensors} == {
        f"t_{d}": (d, 3 * s) for d, s in DTYPE_SIZES.items()
    }


def test_bytearray_and_memoryview_inputs() -> None:
    data = build_file({"w": ("U8", (3,), b"abc")})
    expected = parse_header(data)
    assert parse_header(bytearray(data)) == expected
    assert parse_header(memoryview(data)) == expected


def test_total_size_lets_data_hold_only_the_header() -> None:
    data = build_file({"w": ("F32", (4,), bytes(16))})
    prefix_len = parse_header(data).data_start
    header = parse_header(data[:prefix_len], total_size=len(data))
    assert header == parse_header(data)
    # The layout is checked against total_size, not against len(data).
    assert_invalid(data[:prefix_len], "trailing", total_size=len(data) + 1)


def test_partial_header_in_data_is_a_value_error() -> None:
    data = build_file({"w": ("F32", (4,), bytes(16))})
    with pytest.raises(ValueError, match="whole header") as info:
        parse_header(data[:20], total_size=len(data))
    assert not isinstance(info.value, InvalidSafetensors)


def test_default_limits() -> None:
    assert DEFAULT_MAX_HEADER_BYTES == 100 * 1024 * 1024
    assert DEFAULT_MAX_TENSORS == 1_000_000


# ---------------------------------------------------------------------------- one test per rule


@pytest.mark.parametrize("size", range(8))
def test_file_shorter_than_the_length_prefix(size: int) -> None:
    assert_invalid(b"\x00" * size, f"{size} bytes", "8-byte")


def test_header_length_past_the_end() -> None:
    data = struct.pack("<Q", 100) + b"{}" + b" " * 10
    assert_invalid(data, "header length 100", "20-byte")


def test_header_length_past_the_end_by_one() -> None:
    data = frame("{}")
    assert_invalid(data[:-1], "header length 8", "15-byte")


def test_header_over_max_header_bytes() -> None:
    data = build_file({"w": ("U8", (1,), b"x")})
    header_len = parse_header(data).data_start - 8
    assert parse_header(data, max_header_bytes=header_len).tensors[0].name == "w"
    assert_invalid(data, f"{header_len} bytes", f"limit of {header_len - 1}", max_header_bytes=header_len - 1)


def test_huge_header_length_hits_the_default_limit() -> None:
    data = struct.pack("<Q", 2**63) + b"{}      "
    assert_invalid(data, str(2**63), f"limit of {DEFAULT_MAX_HEADER_BYTES}")


def test_header_not_utf8() -> None:
    assert_invalid(frame(b'{"\xff\xfe":1}'), "not UTF-8")


@pytest.mark.parametrize("text", ["{", '{"a":}', "", "   ", "{'a': 1}", '{"a":1,}', "\ufeff{}"])
def test_header_invalid_json(text: str) -> None:
    assert_invalid(frame(text), "not valid JSON")


@pytest.mark.parametrize(
    ("text", "type_name"),
    [("[]", "list"), ("1", "int"), ('"x"', "str"), ("null", "NoneType"), ("true", "bool"), ("1.5", "float")],
)
def test_header_json_not_an_object(text: str, type_name: str) -> None:
    assert_invalid(frame(text), "JSON object", type_name)


def test_duplicate_tensor_names() -> None:
    text = '{"dup":' + json.dumps(spec("U8", [1], 0, 1)) + ',"dup":' + json.dumps(spec("U8", [1], 1, 2)) + "}"
    assert_invalid(frame(text, b"ab"), "'dup'", "twice")


def test_duplicate_metadata_key() -> None:
    text = '{"__metadata__":{"a":"1"},"__metadata__":{"a":"2"}}'
    assert_invalid(frame(text), "'__metadata__'", "twice")


@pytest.mark.parametrize("dtype", ["F128", "f32", "float32", "", "C64"])
def test_unknown_dtype(dtype: str) -> None:
    assert_invalid(frame({"weight": spec(dtype, [1], 0, 4)}, b"\x00" * 4), "'weight'", f"unknown dtype {dtype!r}")


@pytest.mark.parametrize("dtype", [None, 4, ["F32"], {"F32": 1}, True])
def test_dtype_of_the_wrong_type(dtype) -> None:
    # Unhashable dtypes (a list, an object) must not escape as TypeError.
    assert_invalid(frame({"weight": spec(dtype, [1], 0, 4)}, b"\x00" * 4), "'weight'", "dtype")


@pytest.mark.parametrize(
    "shape", [[-1], [2, -3], [1.5], [2.0], ["2"], [True], [False], [None], [[2]], "2", 2, None, {"0": 2}]
)
def test_bad_shape(shape) -> None:
    assert_invalid(frame({"layer.w": spec("U8", shape, 0, 2)}, b"\x00" * 2), "'layer.w'", "shape")


@pytest.mark.parametrize(
    "offsets",
    [[0], [0, 1, 2], [], "0,1", None, [0, 1.0], [0.0, 1], [-1, 0], [0, -1], [True, 2], [0, True], ["0", "1"], {"0": 1}],
)
def test_malformed_data_offsets(offsets) -> None:
    header = {"bias": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}
    assert_invalid(frame(header, b"\x00"), "'bias'", "data_offsets")


@pytest.mark.parametrize("missing", ["dtype", "shape", "data_offsets"])
def test_missing_entry_field(missing: str) -> None:
    entry = spec("U8", [1], 0, 1)
    del entry[missing]
    assert_invalid(frame({"w": entry}, b"\x00"), "'w'", f"missing {missing}")


@pytest.mark.parametrize("entry", [[1, 2], "F32", 3, None])
def test_entry_not_an_object(entry) -> None:
    assert_invalid(frame({"w": entry}), "'w'", "expected an object")


def test_empty_tensor_name() -> None:
    assert_invalid(frame({"": spec("U8", [1], 0, 1)}, b"\x00"), "empty name")


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**63], [2**40, 2**40, 0], [0, 2**62, 3]])
def test_an_empty_tensor_whose_shape_overflows_is_refused(shape) -> None:
    """A tensor with a 0 dim has no bytes whatever its other dims, but those must still make a
    shape (the safetensors package refuses dims over 2^64 and products that overflow; torch
    refuses sizes and strides of 2^63 or more). Before, such a file was taken: a server committed
    [0, 2^63] and every collector's fetch then raised torch's TypeError, and a publish of [0, 2^70]
    failed INTERNAL (a ValueError building its uint64 description), not InvalidSafetensors."""
    data = frame({"w": spec("F32", shape, 0, 0)})
    assert_invalid(data, "'w'", "shape", "2^63")
    with pytest.raises((TypeError, RuntimeError)):
        torch.empty(shape)


def test_the_largest_shape_of_an_empty_tensor_is_accepted() -> None:
    header = parse_header(frame({"w": spec("F32", [0, 2**63 - 1], 0, 0)}))
    assert header.tensors[0].shape == (0, 2**63 - 1)
    assert torch.empty(header.tensors[0].shape).numel() == 0


def test_end_before_begin() -> None:
    assert_invalid(frame({"w": spec("U8", [0], 8, 4)}, b"\x00" * 8), "'w'", "end 4 is before begin 8")


@pytest.mark.parametrize(
    ("dtype", "shape", "offsets", "needed"),
    [
        ("F32", [2], (0, 4), 8),
        ("F32", [2], (0, 12), 8),
        ("BF16", [2, 3], (0, 6), 12),
        ("U8", [], (0, 0), 1),
        ("I64", [0], (0, 8), 0),
    ],
)
def test_byte_length_not_matching_shape(dtype, shape, offsets, needed) -> None:
    data = frame({"w": spec(dtype, shape, *offsets)}, b"\x00" * offsets[1])
    assert_invalid(data, "'w'", f"needs {needed} bytes", f"span {offsets[1] - offsets[0]}")


def test_offsets_out_of_bounds() -> None:
    assert_invalid(frame({"w": F32_2}, b"\x00" * 4), "'w'", "[0, 8]", "4-byte data section")


def test_offsets_out_of_bounds_huge() -> None:
    assert_invalid(frame({"w": spec("U8", [2**40], 0, 2**40)}, b"\x00" * 4), "'w'", "run past")


def test_overlapping_tensors() -> None:
    data = frame({"a": spec("F32", [2], 0, 8), "b": spec("F32", [2], 4, 12)}, b"\x00" * 12)
    assert_invalid(data, "'b'", "overlap", "ends at 8")


def test_identical_offsets_overlap() -> None:
    data = frame({"a": spec("F32", [2], 0, 8), "b": spec("I64", [1], 0, 8)}, b"\x00" * 8)
    assert_invalid(data, "overlap")


def test_empty_tensor_inside_another_overlaps() -> None:
    data = frame({"a": spec("F32", [2], 0, 8), "e": spec("F32", [0], 4, 4)}, b"\x00" * 8)
    assert_invalid(data, "'e'", "overlap")


def test_gap_between_tensors() -> None:
    data = frame({"a": spec("F32", [1], 0, 4), "b": spec("F32", [1], 8, 12)}, b"\x00" * 12)
    assert_invalid(data, "'b'", "gap of 4 bytes")


def test_gap_before_first_tensor() -> None:
    data = frame({"a": spec("F32", [1], 4, 8)}, b"\x00" * 8)
    assert_invalid(data, "'a'", "gap of 4 bytes")


def test_trailing_bytes_after_last_tensor() -> None:
    data = frame({"a": F32_2}, b"\x00" * 9)
    assert_invalid(data, "9 bytes", "cover 8", "trailing")


def test_trailing_bytes_with_zero_tensors() -> None:
    assert_invalid(frame("{}", b"x"), "1 bytes", "cover 0")


def test_too_many_tensors() -> None:
    data = build_file({f"t{i}": ("U8", (1,), b"x") for i in range(3)})
    assert_invalid(data, "3", "limit of 2", max_tensors=2)
    assert len(parse_header(data, max_tensors=3)) == 3


def test_max_tensors_is_exact_with_and_without_metadata() -> None:
    three = build_file({f"t{i}": ("U8", (1,), b"x") for i in range(3)})
    # Three tensors and no metadata entry are one over a limit of two.
    assert_invalid(three, "limit of 2", max_tensors=2)
    two_with_meta = build_file({f"t{i}": ("U8", (1,), b"x") for i in range(2)}, {"k": "v"})
    assert len(parse_header(two_with_meta, max_tensors=2)) == 2
    assert_invalid(two_with_meta, "limit of 1", max_tensors=1)
    assert len(parse_header(build_header([])[0], max_tensors=0)) == 0


@pytest.mark.parametrize(
    "metadata", [{"k": 1}, {"k": None}, {"k": ["v"]}, {"k": {"a": "b"}}, ["k", "v"], "kv", 3, True]
)
def test_bad_metadata(metadata) -> None:
    assert_invalid(frame({METADATA_KEY: metadata, "w": spec("U8", [1], 0, 1)}, b"\x00"), "'__metadata__'", "strings")


def test_integer_too_long_to_convert_is_invalid_safetensors() -> None:
    # Python refuses to parse integers of more than 4300 digits with a plain ValueError.
    text = '{"w":{"dtype":"U8","shape":[' + "1" * 5000 + '],"data_offsets":[0,1]}}'
    assert_invalid(frame(text, b"x"), "not valid JSON")


def test_deeply_nested_json_is_invalid_safetensors() -> None:
    # json recurses per nesting level; a hostile header must not escape as RecursionError.
    assert_invalid(frame("[" * 100_000), "not valid JSON")
    assert_invalid(frame('{"w":' + "{" * 50_000), "not valid JSON")


# ---------------------------------------------------------------------------- property-based

_names = st.text(min_size=1, max_size=12).filter(lambda s: s != METADATA_KEY)
_dtypes = st.sampled_from(sorted(DTYPE_SIZES))
_shapes = st.lists(st.integers(min_value=0, max_value=4), max_size=3).map(tuple)
_entries = st.lists(st.tuples(_names, _dtypes, _shapes), max_size=8, unique_by=lambda e: e[0])
_metadata = st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)

_settings = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


@_settings
@given(_entries, _metadata)
def test_property_build_then_parse_round_trips(entries, metadata) -> None:
    prefix, placed = build_header([(n, d, s, _nbytes(d, s)) for n, d, s in entries], metadata)
    assert len(prefix) % 8 == 0
    total = sum(_nbytes(d, s) for _, d, s in entries)
    data = prefix + bytes(total)
    header = parse_header(data)
    assert header.data_start == len(prefix)
    assert header.tensors == tuple(placed)
    assert [(e.name, e.dtype, e.shape) for e in header.tensors] == [(n, d, s) for n, d, s in entries]
    assert header.metadata == (dict(metadata) if metadata else None)
    assert_tiles(header, data)


@_settings
@given(
    st.dictionaries(
        st.text(alphabet="abcdefghij._", min_size=1, max_size=6),
        st.tuples(
            st.sampled_from(["float32", "float64", "int8", "int64", "uint16", "bool"]),
            st.lists(st.integers(0, 3), max_size=3),
        ),
        max_size=5,
    )
)
def test_property_safetensors_files_parse_and_slices_match(spec_map) -> None:
    arrays = {name: np.full(shape, 1, dtype=dtype) for name, (dtype, shape) in spec_map.items()}
    data = safetensors.numpy.save(arrays)
    header = parse_header(data)
    assert_tiles(header, data)
    assert {e.name for e in header.tensors} == set(arrays)
    for entry in header.tensors:
        assert entry.shape == arrays[entry.name].shape
        assert data[header.data_start + entry.begin : header.data_start + entry.end] == arrays[entry.name].tobytes()


def _parse_or_invalid(data: bytes) -> None:
    """`data` is a whole file: parse_header either accepts it (and it tiles) or raises InvalidSafetensors."""
    try:
        header = parse_header(data)
    except InvalidSafetensors:
        return
    assert_tiles(header, data)


@_settings
@given(st.binary(max_size=600))
def test_property_arbitrary_bytes(data: bytes) -> None:
    _parse_or_invalid(data)


@_settings
@given(st.binary(max_size=300), st.binary(max_size=64))
def test_property_arbitrary_header_with_correct_length(header: bytes, tail: bytes) -> None:
    _parse_or_invalid(struct.pack("<Q", len(header)) + header + tail)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 40)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(sorted(DTYPE_SIZES)),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["dtype", "shape", "data_offsets", METADATA_KEY, "w", "b"]) | st.text(max_size=4),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)
_json_header = st.dictionaries(
    st.sampled_from(["w", "b", "", METADATA_KEY]) | st.text(max_size=4),
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(sorted(DTYPE_SIZES)) | _json,
            "shape": st.lists(st.integers(-1, 4), max_size=3) | _json,
            "data_offsets": st.lists(st.integers(-1, 40), min_size=2, max_size=2) | _json,
        }
    )
    | _json,
    max_size=4,
)


@_settings
@given(_json_header, st.integers(0, 48), st.booleans())
def test_property_json_like_headers(header: dict, data_len: int, pad: bool) -> None:
    _parse_or_invalid(frame(header, bytes(data_len), pad=pad))


@st.composite
def _valid_files(draw) -> bytes:
    entries = draw(_entries)
    metadata = draw(_metadata)
    prefix, _ = build_header([(n, d, s, _nbytes(d, s)) for n, d, s in entries], metadata)
    total = sum(_nbytes(d, s) for _, d, s in entries)
    return prefix + draw(st.binary(min_size=total, max_size=total))


@_settings
@given(_valid_files(), st.sampled_from(["flip", "insert", "delete"]), st.integers(min_value=0), st.integers(1, 255))
def test_property_mutated_valid_files(data: bytes, op: str, where: int, value: int) -> None:
    _parse_or_invalid(data)  # the unmutated file is valid
    parse_header(data)
    position = where % (len(data) + (1 if op == "insert" else 0))
    if op == "flip":
        mutated = data[:position] + bytes([data[position] ^ value]) + data[position + 1 :]
    elif op == "insert":
        mutated = data[:position] + bytes([value]) + data[position:]
    else:
        mutated = data[:position] + data[position + 1 :]
    _parse_or_invalid(mutated)


@_settings
@given(_valid_files(), st.integers(min_value=0))
def test_property_truncated_valid_files(data: bytes, cut: int) -> None:
    _parse_or_invalid(data[: cut % (len(data) + 1)])


# ---------------------------------------------------------------------------- property-based: targeted damage
# The properties above check that whatever parse_header accepts tiles the file. These take valid
# files, break one rule on purpose, and check that the file is always rejected with a message
# naming the tensor and the rule.

_targeted = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _valid_with_data(draw) -> tuple[dict, bytes, list[tuple[str, str, tuple[int, ...]]]]:
    """(JSON header as a dict, data section, entries) of a valid file with at least one tensor
    that holds bytes."""
    entries = draw(_entries.filter(lambda es: any(_nbytes(d, s) for _, d, s in es)))
    prefix, _ = build_header([(n, d, s, _nbytes(d, s)) for n, d, s in entries], draw(_metadata))
    total = sum(_nbytes(d, s) for _, d, s in entries)
    return json.loads(prefix[8:]), draw(st.binary(min_size=total, max_size=total)), entries


@_targeted
@given(_valid_files(), st.data())
def test_property_any_other_header_length_is_rejected(data: bytes, draw) -> None:
    (length,) = struct.unpack_from("<Q", data)
    other = draw.draw(st.integers(max(0, length - 16), length + 16) | st.integers(0, 2**64 - 1), label="length")
    if other == length:
        other += 1
    damaged = struct.pack("<Q", other) + data[8:]
    error = assert_invalid(damaged)
    if other > len(data) - 8:
        assert str(other) in str(error)  # "header length N runs past..." or "header is N bytes, over the limit"


@_targeted
@given(_valid_with_data(), st.data())
def test_property_moved_tensor_is_rejected(file, draw) -> None:
    header, data, entries = file
    name = draw.draw(st.sampled_from([n for n, d, s in entries if _nbytes(d, s)]), label="tensor")
    begin, end = header[name]["data_offsets"]
    delta = draw.draw(st.integers(-begin, len(data) + 8).filter(bool), label="delta")
    header[name]["data_offsets"] = [begin + delta, end + delta]
    message = str(assert_invalid(frame(header, data)))
    assert any(word in message for word in ("overlap", "gap of", "run past", "trailing")), message
    assert any(repr(n) in message for n, _, _ in entries) or "trailing" in message, message


@_targeted
@given(_valid_with_data(), st.data())
def test_property_dtype_or_shape_not_matching_the_bytes_is_rejected(file, draw) -> None:
    header, data, entries = file
    name, dtype, shape = draw.draw(st.sampled_from([e for e in entries if _nbytes(e[1], e[2])]), label="tensor")
    change = draw.draw(st.sampled_from(["dtype", "unknown_dtype", "shape"]), label="change")
    if change == "dtype":
        dtype = draw.draw(st.sampled_from([d for d in DTYPE_SIZES if DTYPE_SIZES[d] != DTYPE_SIZES[dtype]]))
        fragment = f"needs {_nbytes(dtype, shape)} bytes"
    elif change == "unknown_dtype":
        dtype = draw.draw(st.text(max_size=6).filter(lambda d: d not in DTYPE_SIZES))
        fragment = f"unknown dtype {dtype!r}"
    else:
        shape = (*shape, draw.draw(st.sampled_from([0, 2, 3, 7])))
        fragment = f"needs {_nbytes(dtype, shape)} bytes"
    header[name]["dtype"] = dtype
    header[name]["shape"] = list(shape)
    assert_invalid(frame(header, data), f"tensor {name!r}", fragment)
