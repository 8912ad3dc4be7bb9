"""Negotiate: one unary call picks the transport for a payload and a direction. The server
offers the fast transports it has, in the caller's order of preference, names the same
shared-memory file or bulk ticket for the same payload, and answers TRANSPORT_STREAM when it
offers none of those accepted (and for every publish, until bulk and shared-memory publishes
exist). The client gets bit-exact weights over each transport, placed or not."""

from __future__ import annotations

import grpc
import pytest
import torch
import xxhash

from tests.integration.test_fast_paths import assert_bit_exact, mixed_model, redeem
from weightclient import WeightClient
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
SHM, BULK = pb.TRANSPORT_SHARED_MEMORY, pb.TRANSPORT_BULK


def negotiate(address: str, fetch: pb.FetchRequest, accept=(SHM, BULK), metadata=()) -> pb.NegotiateResponse:
    request = pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=accept, fetch=fetch)
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WeightServiceStub(channel).Negotiate(request, timeout=30, metadata=metadata)


def test_shared_memory_first_names_the_versions_own_file(server, client):
    client.publish(mixed_model(), model=MODEL)
    version = client.publish(mixed_model(seed=1), model=MODEL)
    reply = negotiate(server.address, pb.FetchRequest(model=MODEL))
    described = client.describe(MODEL)
    assert reply.transport == SHM
    assert reply.header.version == version == described.version and reply.header.xxh3 == described.xxh3
    assert [t.name for t in reply.header.tensors] == [t.name for t in described.tensors]
    path = reply.payload.shared_memory.path
    assert path.startswith(str(server.shared_memory.directory)) and not reply.payload.HasField("bulk")
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == reply.payload.byte_size == described.byte_size
    assert xxhash.xxh3_128_hexdigest(data) == reply.payload.xxh3 == reply.header.xxh3


@pytest.mark.parametrize("accept", [(BULK,), (BULK, SHM)])
def test_the_callers_order_of_preference_decides(server, client, accept):
    client.publish(mixed_model(), model=MODEL)
    reply = negotiate(server.address, pb.FetchRequest(model=MODEL, version=1), accept=accept)
    assert reply.transport == BULK and reply.header.version == 1 and reply.payload.HasField("bulk")
    assert not reply.payload.HasField("shared_memory")
    data = redeem(reply.payload.bulk.port, reply.payload.bulk.ticket)
    assert xxhash.xxh3_128_hexdigest(data) == reply.payload.xxh3 == reply.header.xxh3


def test_deltas_and_casts_are_described_as_fetch_describes_them(server, client):
    first = mixed_model()
    client.publish(first, model=MODEL)
    client.publish(dict(first, f32=first["f32"] + 1), model=MODEL)
    delta = negotiate(server.address, pb.FetchRequest(model=MODEL, base_version=1), accept=(SHM,))
    assert delta.header.version == 2 and delta.payload.base_version == 1 and delta.payload.base_xxh3
    assert delta.payload.byte_size < delta.header.byte_size and delta.payload.HasField("shared_memory")
    cast = negotiate(server.address, pb.FetchRequest(model=MODEL, dtype="BF16"), accept=(BULK,))
    assert cast.payload.dtype == "BF16" and cast.payload.HasField("bulk")


def test_the_stream_is_the_answer_when_nothing_accepted_is_offered(make_server):
    srv = make_server(shm_dir=None)  # shared memory off; bulk TCP on
    with WeightClient(srv.address) as c:
        c.publish(mixed_model(), model=MODEL)
    for accept in ((), (SHM,), (pb.TRANSPORT_STREAM,), (99,)):
        reply = negotiate(srv.address, pb.FetchRequest(model=MODEL), accept=accept)
        assert reply.transport == pb.TRANSPORT_STREAM and reply.header.version == 1
        assert not reply.HasField("payload") and not reply.HasField("up_to_date")


def test_up_to_date_and_errors(server, client):
    client.publish(mixed_model(), model=MODEL)
    reply = negotiate(server.address, pb.FetchRequest(model=MODEL, newer_than=1))
    assert reply.up_to_date.latest_version == 1 and not reply.HasField("header") and not reply.HasField("payload")
    cases = [
        (pb.FetchRequest(model="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (pb.FetchRequest(model=MODEL, version=7), grpc.StatusCode.NOT_FOUND, "7"),
        (pb.FetchRequest(model=MODEL, version=0), grpc.StatusCode.INVALID_ARGUMENT, ">= 1"),
        (pb.FetchRequest(model=MODEL, newer_than=5), grpc.StatusCode.OUT_OF_RANGE, "5"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as caught:
            negotiate(server.address, request)
        assert caught.value.code() == code and text in caught.value.details(), (request, caught.value)
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.WeightServiceStub(channel).Negotiate(pb.NegotiateRequest(fetch=pb.FetchRequest(model=MODEL)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "direction" in caught.value.details()


def test_negotiate_needs_a_reader_token(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("publisher trainer publisher-secret-0001\nreader collector reader-secret-00001\n")
    srv = make_server(auth_tokens=str(tokens))
    with WeightClient(srv.address, token="publisher-secret-0001") as c:
        c.publish(mixed_model(), model=MODEL)
    request = pb.FetchRequest(model=MODEL)
    with pytest.raises(grpc.RpcError) as caught:
        negotiate(srv.address, request)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reader = [("authorization", "Bearer reader-secret-00001")]
    assert negotiate(srv.address, request, metadata=reader).transport == SHM
    publish = pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH, publish=pb.PublishHeader(model=MODEL))
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Negotiate(publish, timeout=30, metadata=reader)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        publisher = [("authorization", "Bearer publisher-secret-0001")]
        assert stub.Negotiate(publish, timeout=30, metadata=publisher).transport == pb.TRANSPORT_STREAM


@pytest.mark.parametrize("transport", ["stream", "shm", "bulk", "auto"])
def test_every_transport_delivers_the_same_bits_received_and_placed(server, client, transport):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    result = client.fetch(MODEL, transport=transport)
    assert_bit_exact(result.state_dict(), weights)
    assert result.stats.transport == ("shm" if transport == "auto" else transport)
    targets = {name: torch.zeros_like(t) for name, t in weights.items()}
    placed = client.fetch(MODEL, transport=transport, place=lambda info: targets)
    assert placed.placed and placed.stats.transport == result.stats.transport
    assert_bit_exact(targets, weights)
    assert client.fetch(MODEL, newer_than=1, transport=transport) is None


def test_a_server_without_fast_transports_is_fetched_over_the_stream(make_server):
    srv = make_server(shm_dir=None, bulk_port=None)
    weights = mixed_model()
    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL)
        first = c.fetch(MODEL, transport="auto")
        assert first.stats.transport == "stream"
        assert_bit_exact(first.state_dict(), weights)
        # Nothing failed: the server just offers none, so nothing rests.
        assert c.transports.usable("shm") is None and c.transports.usable("bulk") is None
