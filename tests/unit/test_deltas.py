"""Element deltas (weightserver.protocol.deltas): the forms byte for byte as the proto documents
them, round trips for every element size, and malformed input refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from weightserver.protocol import deltas, framing
from weightserver.protocol.deltas import BITMAP, ENCODING_KEY, SPARSE, apply, apply_delta, encode
from weightserver.protocol.errors import IntegrityError
from weightserver.protocol.safetensors_format import build_header, parse_header
from weightserver.storage.payloads import derive
from weightserver.storage.store import VersionStore

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def u16(*values: int) -> bytes:
    return b"".join(v.to_bytes(2, "little") for v in values)


# ------------------------------------------------------------------ the documented bytes
def test_golden_bitmap_bytes_as_the_proto_documents_them():
    """BF16[5]: elements 1 and 4 change. bitmap: 1 byte, bits 1 and 4 (0x12), then the two new
    values; 5 bytes beat sparse's 12 and the whole tensor's 10."""
    base, new = u16(1, 2, 3, 4, 5), u16(1, 0x1234, 3, 4, 0xABCD)
    assert encode(base, new, 2) == (BITMAP, bytes([0x12, 0x34, 0x12, 0xCD, 0xAB]))
    assert encode(base, new, 2, forms=(SPARSE,)) == ("", new)  # 12 bytes > 10: the whole tensor
    out = bytearray(base)
    assert apply(BITMAP, bytes([0x12, 0x34, 0x12, 0xCD, 0xAB]), memoryview(out), 2) == 2
    assert bytes(out) == new


def test_golden_sparse_bytes_as_the_proto_documents_them():
    """BF16[100]: element 70 (0x46) changes to 0xBEEF. sparse: u32 count 1 for the one block, the
    u16 offset 0x0046, the value: 8 bytes, against bitmap's 15 and the whole tensor's 200."""
    base = bytes(200)
    new = bytearray(base)
    new[140:142] = u16(0xBEEF)
    golden = bytes([1, 0, 0, 0, 0x46, 0x00, 0xEF, 0xBE])
    assert encode(base, bytes(new), 2) == (SPARSE, golden)
    out = bytearray(base)
    apply(SPARSE, golden, memoryview(out), 2)
    assert out == new


def test_sparse_blocks_hold_65536_elements_each():
    n = 3 * 65536 + 10
    base = bytes(n)
    new = bytearray(base)
    for index in (0, 65535, 65536, 3 * 65536 + 9):
        new[index] = 1
    form, blob = encode(base, bytes(new), 1, forms=(SPARSE,))
    assert form == SPARSE
    counts = [int.from_bytes(blob[i : i + 4], "little") for i in range(0, 16, 4)]
    assert counts == [2, 1, 0, 1]
    assert [int.from_bytes(blob[16 + 2 * i : 18 + 2 * i], "little") for i in range(4)] == [0, 65535, 0, 9]


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05, 0.4, 1.0])
def test_round_trip_is_bit_exact(dtype, fraction):
    generator = torch.Generator().manual_seed(7)
    base = (torch.randn(300, 311, generator=generator) * 10).to(dtype)
    new = base.clone()
    mask = torch.rand(base.shape, generator=generator) < fraction
    new[mask] = (
        (torch.randn(int(mask.sum()), generator=generator) * 10 + 1).to(dtype) if dtype != torch.bool else ~new[mask]
    )
    size = base.element_size()
    form, blob = encode(raw(base), raw(new), size)
    out = bytearray(raw(base))
    if form:
        apply(form, blob, memoryview(out), size)
        assert len(blob) < len(out)
    else:
        out = bytearray(blob)
    assert bytes(out) == raw(new)
    changed = int((raw_view(base) != raw_view(new)).sum())
    expected = min(deltas.sizes(base.numel(), changed, size).values())
    assert len(blob) == expected or (fraction > 0.3 and form == "")  # a dense change is not compared in full


@pytest.mark.parametrize("elements", [1000, 2 * deltas.SAMPLE - 1, 64 * deltas.SAMPLE])
def test_a_small_tensor_takes_any_saving_and_a_sampled_one_a_fifth(elements):
    """80% of the elements changed: the bitmap saves 17% of the whole. A tensor the sample covers
    whole (fewer than 2 x SAMPLE elements) is encoded for it; a larger one, sampled, is not compared
    in full for less than a fifth."""
    base = torch.arange(elements, dtype=torch.float32)
    new = base.clone()
    new[torch.arange(elements) % 5 != 0] += 1
    form, blob = encode(raw(base), raw(new), 4)
    saving = 1 - len(blob) / (4 * elements)
    if elements < 2 * deltas.SAMPLE:
        assert form == BITMAP and 0.16 < saving < 0.2
        out = bytearray(raw(base))
        apply(form, blob, memoryview(out), 4)
        assert bytes(out) == raw(new)
    else:
        assert form == "" and blob == raw(new)


@pytest.mark.parametrize("form", [SPARSE, BITMAP])
def test_a_tensor_of_several_windows_rebuilds_bit_exact_in_bounded_memory(form):
    """`apply` writes WINDOW elements at a time: a tensor of 7.5 windows (not a whole number of
    bytes of bitmap) comes back exact, and the temporaries stay near one window's: its unpacked
    bitmap and the 8-byte indices of its changes. Unpacking the whole bitmap and indexing every
    change at once took 3.7 bytes per element here (bitmap), 0.8 (sparse)."""
    import tracemalloc

    n = 15 * deltas.WINDOW // 2 + 3
    base = torch.arange(n, dtype=torch.int32)
    new = base.clone()
    step = 3 if form == BITMAP else 20  # a third changed takes the bitmap, a twentieth the sparse form
    new[torch.rand(n, generator=torch.Generator().manual_seed(3)) < 1 / step] += 1
    new[-1] += 1  # the last element, in the last window's last partial byte
    found, blob = encode(raw(base), raw(new), 4)
    assert found == form
    out = bytearray(raw(base))
    tracemalloc.start()
    try:
        assert apply(form, blob, memoryview(out), 4) == int((new != base).sum())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bytes(out) == raw(new)
    window = deltas.WINDOW + 2 * 8 * deltas.WINDOW / step
    assert peak < 1.25 * window, f"{peak} bytes of temporaries for {n} elements"


def raw_view(tensor: torch.Tensor) -> torch.Tensor:
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(-1).view(words[tensor.element_size()])


def test_negative_zero_and_nan_payloads_count_as_changes():
    base = torch.tensor([0.0, float("nan"), 1.0] * 100)
    new = base.clone()
    new[0], new[1] = -0.0, -float("nan")  # equal as floats (or both NaN), not as bytes
    form, blob = encode(raw(base), raw(new), 4)
    out = bytearray(raw(base))
    apply(form, blob, memoryview(out), 4)
    assert bytes(out) == raw(new)


# ------------------------------------------------------------------ malformed input
def sparse_blob(n: int, changes: dict[int, int]) -> bytes:
    """A 1-byte-element sparse delta written by hand (not by encode)."""
    blocks = -(-n // 65536)
    counts = [0] * blocks
    for index in changes:
        counts[index >> 16] += 1
    return (
        b"".join(c.to_bytes(4, "little") for c in counts)
        + b"".join((i & 0xFFFF).to_bytes(2, "little") for i in sorted(changes))
        + bytes(changes[i] for i in sorted(changes))
    )


@pytest.mark.parametrize(
    "form, blob, message",
    [
        (SPARSE, sparse_blob(100, {3: 9})[:-1], "truncated"),
        (SPARSE, sparse_blob(100, {3: 9}) + b"\0", "truncated or padded"),
        (SPARSE, b"\2\0\0\0" + sparse_blob(100, {3: 9})[4:], "sum to 2"),
        (SPARSE, sparse_blob(100, {100: 9}), "names element 100 of a tensor of 100"),
        (BITMAP, b"\0" * 5, "shorter than its 13-byte map"),
        (BITMAP, bytes(12) + b"\x10", "past the tensor's 100"),
        (BITMAP, bytes(12) + b"\x01" + b"\x07\x07", "marks 1 elements but carries 2 bytes"),
        ("xor", b"", "unknown element delta form"),
    ],
    ids=["truncated", "padded", "counts", "out-of-range", "short-map", "bits-past-n", "values", "form"],
)
def test_a_malformed_delta_is_refused_and_writes_nothing(form, blob, message):
    out = bytearray(range(100))
    with pytest.raises(IntegrityError, match=message):
        apply(form, blob, memoryview(out), 1, "tensor 'x'")
    assert out == bytearray(range(100))


def versions(*tensors: dict[str, torch.Tensor]):
    store = VersionStore()
    return [store.publish("m", save(t)) for t in tensors]


def test_a_payload_rebuilds_the_version_and_names_its_encoded_tensors():
    generator = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(4096, generator=generator).to(torch.bfloat16), "b": torch.zeros(3), "i": torch.arange(9)}
    second = {**first, "w": first["w"].clone(), "i": first["i"] + 1}
    second["w"][::100] += 1
    base, target = versions(first, second)
    data = derive(
        target.data, target.header, keep=lambda e: e.name != "b", base=(base.data, base.header), forms=(SPARSE, BITMAP)
    )
    payload = parse_header(data)
    assert json.loads(payload.metadata[ENCODING_KEY]) == {"w": SPARSE}
    assert {(t.name, t.dtype) for t in payload.tensors} == {("w", "U8"), ("i", "I64")}  # `i` changed everywhere: whole
    rebuilt, names = apply_delta(base.data, base.header, list(target.header.tensors), target.byte_size, data)
    assert bytes(rebuilt) == bytes(target.data) and sorted(names) == ["i", "w"]


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_a_payload_fed_in_pieces_rebuilds_in_place_as_it_arrives(piece):
    """The sink a transport receives into: any cut of the payload rebuilds the version in the base's
    own bytes, bit for bit, with the payload's xxh3 (its memory: test_element_deltas.py)."""
    import xxhash

    generator = torch.Generator().manual_seed(1)
    first = {f"w{i}": torch.randn(3000 + i, generator=generator) for i in range(4)}
    second = {name: t.clone() for name, t in first.items()}
    second["w0"][::50] += 1  # an element delta
    second["w1"] += 1  # whole
    second["w3"][7] += 1
    base, target = versions(first, second)
    keep, forms = (lambda e: e.name != "w2"), (SPARSE, BITMAP)
    data = derive(target.data, target.header, keep=keep, base=(base.data, base.header), forms=forms)
    rebuilt = bytearray(base.data)
    layout = list(target.header.tensors)
    rebuild = deltas.Rebuild.on(rebuilt, base.header, layout, target.byte_size, len(data), in_place=True)
    for start in range(0, len(data), piece):
        chunk = memoryview(data)[start : start + piece]
        while chunk.nbytes:
            view = rebuild.target(chunk.nbytes)
            view[:] = chunk[: view.nbytes]
            rebuild.advance(view.nbytes)
            chunk = chunk[view.nbytes :]
    assert not rebuild.problem and rebuild.xxh3() == xxhash.xxh3_128_hexdigest(data)
    assert bytes(rebuilt) == bytes(target.data) and rebuild.rebuilt.obj is rebuilt  # in place
    assert sorted(rebuild.changed) == ["w0", "w1", "w3"] and set(rebuild.forms) == {"w0", "w3"}


def test_a_malformed_payload_is_hashed_to_its_end_so_a_bad_delta_is_told_from_a_bad_transfer():
    import xxhash

    (base,) = versions({"w": torch.ones(4)})
    payload = malformed_payload([("ghost", "F32", (2,), bytes(8)), ("w", "F32", (4,), bytes(16))])
    rebuild = deltas.Rebuild.on(base.data, base.header, list(base.header.tensors), base.byte_size, len(payload))
    framing.receive_chunks([memoryview(payload)], rebuild)
    assert "'ghost' of the delta is not in the version" in rebuild.problem
    assert rebuild.xxh3() == xxhash.xxh3_128_hexdigest(payload)  # the bytes sent: the delta is bad
    assert bytes(rebuild.rebuilt) == bytes(base.data)  # a copy, and nothing written


def malformed_payload(entries, metadata=None) -> bytes:
    prefix, _ = build_header(((n, d, s, len(b)) for n, d, s, b in entries), metadata)
    return prefix + b"".join(b for *_, b in entries)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x00" * 3, "not a valid safetensors file"),
        (malformed_payload([("ghost", "F32", (2,), bytes(8))]), "'ghost' of the delta is not in the version"),
        (malformed_payload([("w", "F16", (4,), bytes(8))]), "is F16\\[4\\]; the version's is F32\\[4\\]"),
        (malformed_payload([("w", "F32", (2,), bytes(8))], {ENCODING_KEY: '{"w": "sparse"}'}), "U8 of one dimension"),
        (malformed_payload([("w", "U8", (1,), b"\0")], {ENCODING_KEY: "[1]"}), "not a JSON object"),
        (malformed_payload([("w", "U8", (1,), b"\1")], {ENCODING_KEY: '{"w": "bitmap"}'}), "carries 0 bytes"),
    ],
    ids=["not-safetensors", "unknown-tensor", "wrong-dtype", "encoded-not-u8", "metadata", "bad-bitmap"],
)
def test_a_malformed_delta_payload_is_an_integrity_error(payload, message):
    (base,) = versions({"w": torch.ones(4)})
    layout = list(base.header.tensors)
    with pytest.raises(IntegrityError, match=message):
        apply_delta(base.data, base.header, layout, base.byte_size, payload)


def test_a_base_laid_out_otherwise_is_not_rebuilt_on():
    base, other = versions({"w": torch.ones(4)}, {"w": torch.ones(5)})
    assert apply_delta(base.data, base.header, list(other.header.tensors), other.byte_size, b"") is None
