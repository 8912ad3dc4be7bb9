"""IncomingDigests against the one-shot digests (digests.xxh3_hex / tensor_digests, sha256,
parse_header), whatever the cuts the bytes arrive in."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightserver.protocol.digests import PREFIX_BYTES, FileDigests, IncomingDigests, tensor_digests, xxh3_hex
from weightserver.protocol.errors import InvalidSafetensors
from weightserver.protocol.safetensors_format import build_header, parse_header


def make_file(tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None) -> bytes:
    prefix, _ = build_header([(name, dtype, shape, len(raw)) for name, dtype, shape, raw in tensors], metadata)
    return prefix + b"".join(raw for *_, raw in tensors)


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# An empty tensor between two others, F16, odd sizes, and a header long enough (metadata) to
# span many small chunks.
FILE = make_file(
    [
        ("embed", "F32", (3, 5), random_bytes(60, 1)),
        ("empty", "F32", (0, 4), b""),
        ("half", "F16", (7,), random_bytes(14, 2)),
        ("mask", "BOOL", (3,), b"\x01\x00\x01"),
        ("tail", "U8", (1,), b"\x07"),
    ],
    {"note": "x" * 300},
)
HEADER_END = parse_header(FILE).data_start


def one_shot(data: bytes) -> FileDigests:
    header = parse_header(data)
    return FileDigests(xxh3_hex(data), tensor_digests(data, header), header, hashlib.sha256(data).hexdigest())


def digests_in_pieces(data: bytes, cuts: list[int], *, sha256: bool = True) -> FileDigests:
    incoming = IncomingDigests(memoryview(bytearray(data)), sha256=sha256)
    for end in [*sorted(cuts), len(data)]:
        incoming.advance(end)
    return incoming.finish()


def test_the_file_is_what_the_cases_need() -> None:
    header = parse_header(FILE)
    assert [t.dtype for t in header.tensors] == ["F32", "F32", "F16", "BOOL", "U8"]
    assert [t.end - t.begin for t in header.tensors][1] == 0
    assert HEADER_END > 300


@pytest.mark.parametrize(
    "cuts",
    [
        [],  # the whole file at once
        [1, 7],  # the length prefix in pieces
        [PREFIX_BYTES],  # the prefix alone, then the rest
        [PREFIX_BYTES + 1, HEADER_END // 2, HEADER_END - 1],  # the header split across chunks
        [HEADER_END],  # exactly the header, then the data
        [HEADER_END + 1, HEADER_END + 60, HEADER_END + 61],  # around the empty tensor
        [len(FILE) - 1],  # all but the last byte
        list(range(1, len(FILE))),  # one byte at a time
    ],
    ids=["whole", "prefix", "prefix_alone", "header_split", "header_exact", "empty_tensor", "last_byte", "bytewise"],
)
def test_incoming_digests_match_the_one_shot_digests(cuts: list[int]) -> None:
    assert digests_in_pieces(FILE, cuts) == one_shot(FILE)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(FILE)), max_size=40))
def test_incoming_digests_match_for_any_cuts(cuts: list[int]) -> None:
    assert digests_in_pieces(FILE, cuts) == one_shot(FILE)


def test_sha256_only_on_request_and_a_file_of_only_a_header() -> None:
    no_tensors = make_file([])
    assert digests_in_pieces(FILE, [100], sha256=False).sha256 is None
    assert digests_in_pieces(no_tensors, [3]) == one_shot(no_tensors)


def test_a_wrong_digest_is_told_apart() -> None:
    """The comparison can fail: one flipped data byte changes the file's and its tensor's xxh3."""
    changed = bytearray(FILE)
    changed[-1] ^= 1
    theirs, ours = digests_in_pieces(bytes(changed), [HEADER_END]), one_shot(FILE)
    assert theirs.xxh3 != ours.xxh3 and theirs.sha256 != ours.sha256
    assert theirs.tensor_xxh3["tail"] != ours.tensor_xxh3["tail"]
    assert {k: v for k, v in theirs.tensor_xxh3.items() if k != "tail"} == {
        k: v for k, v in ours.tensor_xxh3.items() if k != "tail"
    }


def test_a_bad_header_is_refused_once_it_is_in_and_before_the_data() -> None:
    bad = FILE.replace(b'"F16"', b'"F17"')
    incoming = IncomingDigests(memoryview(bytearray(bad)))
    incoming.advance(HEADER_END - 1)  # not all in yet: nothing to say
    with pytest.raises(InvalidSafetensors, match="F17"):
        incoming.advance(HEADER_END)


def test_header_limits_apply() -> None:
    incoming = IncomingDigests(memoryview(bytearray(FILE)), header_limits={"max_tensors": 2})
    with pytest.raises(InvalidSafetensors, match="tensors"):
        incoming.advance(len(FILE))


def test_finish_needs_every_byte_and_a_header() -> None:
    incoming = IncomingDigests(memoryview(bytearray(FILE)))
    incoming.advance(10)
    incoming.advance(5)  # behind what was hashed: nothing happens
    assert incoming.hashed == 10
    with pytest.raises(ValueError, match="10 of"):
        incoming.finish()
    short = IncomingDigests(memoryview(bytearray(b"\x01\x02\x03")))
    with pytest.raises(InvalidSafetensors, match="8-byte header length"):
        short.advance(3)  # the file ended before a header could
