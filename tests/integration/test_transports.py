"""The transport layer in process: TransportChain's order and retry rule with fake transports,
the PlacedReceiver fed in awkward pieces. Publishing over each transport: test_publish_transports."""

from __future__ import annotations

import time

import pytest
import xxhash

from tests.integration.test_fast_paths import assert_bit_exact, mixed_model
from weightclient import InvalidRequest
from weightclient.placement import PlacedReceiver
from weightclient.transports import (
    NotOffered,
    Offer,
    TransportChain,
    TransportFailed,
)
from weightclient.transports.base import Transport
from weightserver.protocol.version_info import TensorInfo, VersionInfo
from weightserver.v1 import weights_pb2 as pb

MODEL = "policy"


class FakeTransport(Transport):
    """An in-process transport: hands out `data` for any offer, or fails as told."""

    def __init__(self, name: str, kind: int, data: bytes = b"", fail: bool = False) -> None:
        self.name, self.kind, self.data, self.fail = name, kind, data, fail
        self.received = 0

    def upload(self, payload, parts, *, deadline, progress):
        raise NotOffered(self.name)

    def receive(self, offer, *, into, progress):
        self.received += 1
        if self.fail:
            raise TransportFailed(f"{self.name} is broken")
        return memoryview(self.data)

    def receive_placed(self, offer, views):
        raise TransportFailed("no placing here")


def chain(rest_seconds: float = 60.0) -> TransportChain:
    shm = FakeTransport("shm", pb.TRANSPORT_SHARED_MEMORY)
    bulk = FakeTransport("bulk", pb.TRANSPORT_BULK)
    return TransportChain([shm, bulk], FakeTransport("stream", pb.TRANSPORT_STREAM), rest_seconds=rest_seconds)


def test_auto_tries_the_fast_transports_in_order_and_a_named_one_alone():
    transports = chain()
    assert [t.name for t in transports.order("auto")] == ["shm", "bulk", "stream"]
    assert [t.name for t in transports.order("bulk")] == ["bulk", "stream"]
    assert [t.name for t in transports.order("stream")] == ["stream"]
    assert transports.choices == ("auto", "shm", "bulk", "stream")
    with pytest.raises(InvalidRequest, match="auto, shm, bulk, stream"):
        transports.order("carrier-pigeon")


def test_a_failed_transport_rests_then_is_tried_again():
    transports = chain(rest_seconds=0.2)
    shm = transports.by_name["shm"]
    assert transports.usable("shm") is None
    transports.failed(shm, "another host")
    assert transports.usable("shm") is False
    assert [t.name for t in transports.order("auto")] == ["bulk", "stream"]
    assert [t.name for t in transports.order("shm")] == ["shm", "stream"]  # named explicitly: always tried
    time.sleep(0.25)
    assert [t.name for t in transports.order("auto")] == ["shm", "bulk", "stream"]
    transports.worked(shm)
    assert transports.usable("shm") is True


def test_a_fast_transport_that_fails_falls_back_to_the_stream_bit_exact(server, client):
    """A fake bulk transport (kind TRANSPORT_BULK, so the server's ticket is routed to it)
    that fails: the client fetches the same version over the real stream and rests the fake."""
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    broken = FakeTransport("bulk", pb.TRANSPORT_BULK, fail=True)
    client.transports = TransportChain([broken], client.transports.stream)
    result = client.fetch(MODEL, transport="auto")
    assert broken.received == 1 and result.stats.transport == "stream"
    assert_bit_exact(result.state_dict(), weights)
    assert client.transports.usable("bulk") is False
    assert client.fetch(MODEL, transport="auto").stats.transport == "stream"
    assert broken.received == 1  # resting: not asked again


def test_bytes_that_fail_their_digest_over_a_fast_transport_come_again_over_the_stream(server, client):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    liar = FakeTransport("bulk", pb.TRANSPORT_BULK, data=bytes(client.describe(MODEL).byte_size))
    client.transports = TransportChain([liar], client.transports.stream)
    result = client.fetch(MODEL, transport="bulk")
    assert liar.received == 1 and result.stats.transport == "stream"
    assert_bit_exact(result.state_dict(), weights)


def version_of(tensors: dict[str, bytes], header_bytes: int = 40) -> tuple[VersionInfo, bytes]:
    """A safetensors-shaped file: 8-byte prefix, a header of padding, the tensors back to back."""
    body, entries, position = b"", [], 0
    for name, data in tensors.items():
        entries.append(
            TensorInfo(name, "U8", (len(data),), position, position + len(data), xxhash.xxh3_128_hexdigest(data))
        )
        body += data
        position += len(data)
    file = header_bytes.to_bytes(8, "little") + b" " * header_bytes + body
    return VersionInfo(MODEL, 1, len(file), "", None, tensors=tuple(entries)), file


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_the_placed_receiver_scatters_pieces_of_any_size(piece):
    tensors = {"a": bytes(range(200)) * 30, "b": b"", "c": b"xyz" * 5000, "skipped": b"q" * 999}
    info, file = version_of(tensors)
    views = {name: memoryview(bytearray(len(data))) for name, data in tensors.items() if name != "skipped"}
    receiver = PlacedReceiver(info, views)
    position = 0
    while not receiver.done:
        target = receiver.target(piece)
        target[:] = file[position : position + target.nbytes]
        receiver.advance(target.nbytes)
        position += target.nbytes
    assert position == len(file) and receiver.bad() == []
    assert {name: bytes(v) for name, v in views.items()} == {n: d for n, d in tensors.items() if n != "skipped"}


def test_the_placed_receiver_names_tensors_that_fail_and_refuses_a_layout_that_does_not_fit():
    info, file = version_of({"a": b"a" * 100, "b": b"b" * 100})
    views = {"a": memoryview(bytearray(100)), "b": memoryview(bytearray(100))}
    receiver = PlacedReceiver(info, views)
    damaged = bytearray(file)
    damaged[-1] ^= 0xFF
    position = 0
    while not receiver.done:
        target = receiver.target()
        target[:] = damaged[position : position + target.nbytes]
        receiver.advance(target.nbytes)
        position += target.nbytes
    assert receiver.bad() == ["b"]
    with pytest.raises(ValueError):
        receiver = PlacedReceiver(info, views)
        first = receiver.target()
        first[:] = (10_000).to_bytes(8, "little")  # a header far longer than the file
        receiver.advance(8)


def test_a_stream_offer_is_whole_unless_it_is_a_delta_or_a_cast(server, client):
    client.publish(mixed_model(), model=MODEL)
    with pytest.raises(NotOffered):  # a publish's bytes go in the Publish call itself
        client.transports.stream.upload(pb.Payload(byte_size=1), [memoryview(b"x")], deadline=None, progress=None)
    info = client.describe(MODEL)
    assert Offer(info, pb.Payload(xxh3=info.xxh3)).whole_version
    assert not Offer(info, pb.Payload(xxh3=info.xxh3, dtype="BF16")).whole_version
