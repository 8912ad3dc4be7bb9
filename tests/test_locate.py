"""Locate: Fetch's answer for fast-path readers in one unary reply. The server names the same
shared-memory file or bulk ticket a Fetch stream would; the client uses it whenever it accepts
a fast path, falls back to Fetch when the server offers none or predates Locate, and gets
bit-exact weights either way."""

from __future__ import annotations

import grpc
import pytest
import torch
import xxhash

from tests.test_fast_paths import assert_bit_exact, mixed_model, redeem
from weightclient import WeightClient
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"


def locate(address: str, request: pb.FetchRequest, metadata=()) -> pb.LocateResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WeightServiceStub(channel).Locate(request, timeout=30, metadata=metadata)


def test_locate_names_the_shared_memory_file_a_fetch_stream_would(server, client):
    client.publish(mixed_model(), model=MODEL)
    version = client.publish(mixed_model(seed=1), model=MODEL)
    reply = locate(server.address, pb.FetchRequest(model=MODEL, accept_shared_memory=True, accept_bulk=True))
    described = client.describe(MODEL)
    assert reply.header.version == version == described.version and reply.header.sha256 == described.sha256
    assert [t.name for t in reply.header.tensors] == [t.name for t in described.tensors]
    path = reply.payload.shared_memory.path
    assert path.startswith(str(server.shared_memory.directory)) and not reply.payload.HasField("bulk")
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == reply.payload.byte_size == described.byte_size
    assert xxhash.xxh3_128_hexdigest(data) == reply.payload.xxh3 == reply.header.xxh3


def test_locate_hands_out_a_bulk_ticket_when_shared_memory_is_not_accepted(server, client):
    client.publish(mixed_model(), model=MODEL)
    reply = locate(server.address, pb.FetchRequest(model=MODEL, version=1, accept_bulk=True))
    assert reply.header.version == 1 and reply.payload.HasField("bulk")
    data = redeem(reply.payload.bulk.port, reply.payload.bulk.ticket)
    assert xxhash.xxh3_128_hexdigest(data) == reply.payload.xxh3 == reply.header.xxh3


def test_locate_describes_deltas_and_casts_like_fetch(server, client):
    first = mixed_model()
    client.publish(first, model=MODEL)
    second = dict(first, f32=first["f32"] + 1)
    client.publish(second, model=MODEL)
    delta = locate(server.address, pb.FetchRequest(model=MODEL, base_version=1, accept_shared_memory=True))
    assert delta.header.version == 2 and delta.payload.base_version == 1 and delta.payload.base_xxh3
    assert delta.payload.byte_size < delta.header.byte_size
    cast = locate(server.address, pb.FetchRequest(model=MODEL, dtype="BF16", accept_bulk=True))
    assert cast.payload.dtype == "BF16" and cast.payload.HasField("bulk")


def test_without_a_fast_path_locate_answers_the_header_alone(make_server):
    srv = make_server(shm_dir=None)  # shared memory off; bulk TCP on
    with WeightClient(srv.address) as c:
        c.publish(mixed_model(), model=MODEL)
    for request in (
        pb.FetchRequest(model=MODEL),
        pb.FetchRequest(model=MODEL, accept_shared_memory=True),
    ):
        reply = locate(srv.address, request)
        assert reply.header.version == 1 and not reply.HasField("payload") and not reply.HasField("up_to_date")


def test_locate_up_to_date_and_errors(server, client):
    client.publish(mixed_model(), model=MODEL)
    reply = locate(server.address, pb.FetchRequest(model=MODEL, newer_than=1, accept_shared_memory=True))
    assert reply.up_to_date.latest_version == 1 and not reply.HasField("header") and not reply.HasField("payload")
    cases = [
        (pb.FetchRequest(model="nope", accept_bulk=True), grpc.StatusCode.NOT_FOUND, "nope"),
        (pb.FetchRequest(model=MODEL, version=7, accept_bulk=True), grpc.StatusCode.NOT_FOUND, "7"),
        (pb.FetchRequest(model=MODEL, version=0, accept_bulk=True), grpc.StatusCode.INVALID_ARGUMENT, ">= 1"),
        (pb.FetchRequest(model=MODEL, newer_than=5, accept_bulk=True), grpc.StatusCode.OUT_OF_RANGE, "5"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as caught:
            locate(server.address, request)
        assert caught.value.code() == code and text in caught.value.details(), (request, caught.value)


def test_locate_needs_a_reader_token(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("publisher trainer publisher-secret-0001\nreader collector reader-secret-00001\n")
    srv = make_server(auth_tokens=str(tokens))
    with WeightClient(srv.address, token="publisher-secret-0001") as c:
        c.publish(mixed_model(), model=MODEL)
    request = pb.FetchRequest(model=MODEL, accept_bulk=True)
    with pytest.raises(grpc.RpcError) as caught:
        locate(srv.address, request)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = locate(srv.address, request, metadata=[("authorization", "Bearer reader-secret-00001")])
    assert reply.payload.HasField("bulk") or reply.payload.HasField("shared_memory")


@pytest.mark.parametrize("transport", ["shm", "bulk", "auto"])
@pytest.mark.parametrize("asked_with", ["locate", "fetch-stream"])
def test_the_client_gets_the_same_bits_through_locate_and_the_fetch_stream(server, client, transport, asked_with):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    if asked_with == "fetch-stream":
        client._locate_usable = False
    result = client.fetch(MODEL, transport=transport)
    assert_bit_exact(result.state_dict(), weights)
    assert result.stats.transport == ("shm" if transport == "auto" else transport)
    assert client._locate_usable is (asked_with == "locate")
    targets = {name: torch.zeros_like(t) for name, t in weights.items()}
    placed = client.fetch(MODEL, transport=transport, place=lambda info: targets)
    assert placed.placed and placed.stats.transport == result.stats.transport
    assert_bit_exact(targets, weights)
    assert client.fetch(MODEL, newer_than=1, transport=transport) is None


def test_a_server_without_fast_paths_for_this_client_is_fetched_with_the_stream_from_then_on(make_server):
    srv = make_server(shm_dir=None, bulk_port=None)
    weights = mixed_model()
    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL)
        first = c.fetch(MODEL, transport="auto")
        assert first.stats.transport == "stream" and c._locate_usable is False
        assert_bit_exact(first.state_dict(), weights)


def test_a_server_that_predates_locate_is_fetched_with_the_stream(make_server, monkeypatch):
    """An older server answers Locate with UNIMPLEMENTED (gRPC's own status for an unknown
    method): the client fetches over the Fetch stream, fast paths included, and stops asking."""
    import weightserver.server as server_module

    def without_locate(service: str, handlers: dict):
        return real(service, {name: h for name, h in handlers.items() if name != "Locate"})

    real = grpc.method_handlers_generic_handler
    monkeypatch.setattr(server_module.grpc, "method_handlers_generic_handler", without_locate)
    srv = make_server()
    monkeypatch.undo()
    weights = mixed_model()
    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL)
        with pytest.raises(grpc.RpcError) as caught:
            locate(srv.address, pb.FetchRequest(model=MODEL, accept_bulk=True))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        for _ in range(2):
            result = c.fetch(MODEL, transport="shm")
            assert result.stats.transport == "shm" and c._locate_usable is False
            assert_bit_exact(result.state_dict(), weights)
