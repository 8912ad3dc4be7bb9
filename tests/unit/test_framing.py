"""weightserver.protocol.framing against the generated classes: hand-framed chunks parse as the
messages they claim to be, and generated messages parse back through the framing."""

from __future__ import annotations

import pytest

from weightserver.protocol import framing
from weightserver.v1 import weights_pb2 as pb

SIZES = [0, 1, 127, 128, 16383, 16384, 1 << 20, (1 << 21) + 5]


@pytest.mark.parametrize("size", SIZES)
def test_fetch_chunks_round_trip_through_the_generated_class(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    chunk_bytes = max(1, size // 3) if size else 64
    messages = list(framing.chunk_messages(data, chunk_bytes))
    assert len(messages) == -(-size // chunk_bytes)
    parsed = [pb.FetchResponse.FromString(m) for m in messages]
    assert all(m.WhichOneof("kind") == "chunk" for m in parsed)
    assert b"".join(m.chunk for m in parsed) == data
    assert [m.SerializeToString() for m in parsed] == messages  # the canonical encoding
    assert b"".join(bytes(framing.deserialize_fetch_response(m)) for m in messages) == data


@pytest.mark.parametrize("size", SIZES)
def test_publish_chunks_round_trip_through_the_generated_class(size):
    data = memoryview(bytes(size))
    parts = [data[: size // 2], data[size // 2 :]]
    message = framing.chunk_message(parts)
    assert message == pb.PublishRequest(chunk=bytes(data)).SerializeToString()
    assert pb.PublishRequest.FromString(message).chunk == bytes(data)
    assert bytes(framing.chunk_of(message, framing.PUBLISH_CHUNK_TAG)) == bytes(data)


def test_other_messages_are_not_taken_for_chunks():
    header = pb.FetchResponse(header=pb.VersionInfo(model="policy", version=3))
    for message in (header, pb.FetchResponse(up_to_date=pb.UpToDate(latest_version=2)), pb.FetchResponse()):
        raw = message.SerializeToString()
        assert framing.chunk_of(raw) is None
        assert framing.deserialize_fetch_response(raw) == message
    truncated = framing.chunk_message([memoryview(b"abcdef")], framing.FETCH_CHUNK_TAG)[:-1]
    assert framing.chunk_of(truncated) is None  # a length that does not match is no chunk


def test_the_tags_come_from_the_descriptors():
    for message, tag in ((pb.FetchResponse, framing.FETCH_CHUNK_TAG), (pb.PublishRequest, framing.PUBLISH_CHUNK_TAG)):
        field = message.DESCRIPTOR.fields_by_name["chunk"]
        assert tag == bytes([field.number << 3 | 2])
    assert framing.serialize(b"raw") == b"raw"
    assert framing.serialize(pb.UpToDate(latest_version=1)) == pb.UpToDate(latest_version=1).SerializeToString()
