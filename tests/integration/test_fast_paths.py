"""Every fast path (shared memory, bulk TCP, deltas, server-side casts, the reusing updater) is
checked against the plain gRPC stream on a real server: bit-exact wherever no cast is asked
for, and equal to torch's own rounding where one is."""

from __future__ import annotations

import dataclasses
import mmap
import os
import secrets
import socket
import threading

import grpc
import numpy as np
import pytest
import torch
import xxhash
from waiting import wait_until

import weightclient.transports.bulk as bulk_transport
import weightserver.transports.bulk as bulk
from weightclient import IntegrityError, InvalidRequest, WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightclient.transports import SharedMemoryTransport, TransportFailed
from weightserver.service.servicer import WeightServicer
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
FAST_TRANSPORTS = ("stream", "shm", "bulk", "auto")


# ---------------------------------------------------------------------- helpers
def raw(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes as stored (NaN payloads, -0.0 and all)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert raw(got) == raw(want), name


def f32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.float32))


def special_f32() -> torch.Tensor:
    """float32 values that stress a cast: NaN, +-inf, +-0, subnormals (of f32 and of f16),
    exact rounding ties (bf16 and f16), values that overflow f16 or round bf16 up to inf."""
    bits = [
        0x7FC00000,  # NaN
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x80000000,  # -0.0
        0x00000000,  # +0.0
        0x00000001,  # smallest f32 subnormal
        0x807FFFFF,  # largest negative f32 subnormal
        0x00800000,  # smallest f32 normal
        0x3F808000,  # 1 + 2^-8: bf16 tie, rounds down to even 1.0
        0x3F818000,  # bf16 tie between 0x3F81 and 0x3F82: rounds up to even
        0x3F808001,  # just above a bf16 tie: rounds up
        0x3F801000,  # 1 + 2^-11: f16 tie, rounds to even 1.0
        0x3F803000,  # 1 + 3 * 2^-11: f16 tie, rounds up to even
        0x7F7FFFFF,  # largest f32: bf16 rounds it to +inf, f16 overflows to +inf
        0xFF7FFFFF,  # its negative
    ]
    values = f32_from_bits(bits)
    more = torch.tensor(
        [65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 1e-5, -1e-5, 6.1e-5, 1e-40, 1 / 3, -2.5]
    )
    return torch.cat([values, more, torch.randn(4001, generator=torch.Generator().manual_seed(3)) * 100])


def mixed_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every kind of tensor a policy may hold, and one larger than gRPC's 4 MiB message limit."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(64, 33, generator=gen),
        "special": special_f32(),
        "f16": torch.randn(100, generator=gen).half(),
        "bf16": torch.randn(7, 9, generator=gen).bfloat16(),
        "f64": torch.randn(5, 3, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (50,), generator=gen),
        "bool": torch.rand(77, generator=gen) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "big": torch.randn(1_200_000, generator=gen),  # 4.8 MB
    }


def layered_model(seed: int = 0, layers: int = 20, numel: int = 16384) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i:02d}.weight": torch.randn(numel, generator=gen) for i in range(layers)}


def servicer_of(server) -> WeightServicer:
    """The running servicer."""
    assert isinstance(server.servicer, WeightServicer)
    return server.servicer


def payload_files(server) -> list:
    return sorted(p for p in server.shared_memory.directory.rglob("*.safetensors"))


def raw_fetch(address: str, request: pb.FetchRequest) -> list[bytes]:
    """Every Fetch message exactly as it came off the wire."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/weightserver.v1.WeightService/Fetch", request_serializer=pb.FetchRequest.SerializeToString
        )
        return list(call(request, timeout=30))


def bulk_ticket(server, model: str = MODEL, version: int | None = None) -> pb.Payload:
    """A bulk ticket for the latest version (or exactly `version`), asked for with the generated stub."""
    request = pb.NegotiateRequest(
        direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_BULK], fetch=pb.FetchRequest(model=model, version=version)
    )
    with grpc.insecure_channel(server.address) as channel:
        answer = pb_grpc.WeightServiceStub(channel).Negotiate(request, timeout=30)
    assert answer.transport == pb.TRANSPORT_BULK and answer.payload.HasField("bulk")
    return answer.payload


def redeem(port: int, ticket: bytes) -> bytes:
    """Send a ticket to the bulk port and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.settimeout(10)
        conn.sendall(ticket)
        conn.shutdown(socket.SHUT_WR)  # nothing more comes: a short ticket stays short
        received = bytearray()
        while part := conn.recv(1 << 20):
            received += part
    return bytes(received)


# ---------------------------------------------------------------------- transports
@pytest.mark.parametrize("transport", FAST_TRANSPORTS)
def test_every_transport_is_bit_exact_with_the_plain_stream(client, transport):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    plain = client.fetch(MODEL, transport="stream")
    plain_bytes = client.fetch_bytes(MODEL, transport="stream")

    result = client.fetch(MODEL, transport=transport)

    assert result.stats.transport == ("shm" if transport == "auto" else transport)
    assert result.stats.wire_bytes == plain_bytes.info.byte_size
    assert (result.version, result.partial, result.base_version, result.dtype) == (1, False, 0, "")
    assert_bit_exact(result.tensors, plain.tensors)
    assert_bit_exact(result.tensors, weights)
    assert bytes(result.data) == bytes(plain_bytes.data)
    assert xxhash.xxh3_128_hexdigest(result.data) == result.info.xxh3


@pytest.mark.parametrize("transport", ["stream", "bulk"])
def test_socket_transports_receive_into_the_callers_buffer(client, transport):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    size = client.latest(MODEL).byte_size
    buffer = bytearray(size + 4096)

    result = client.fetch(MODEL, transport=transport, into=memoryview(buffer))

    assert result.data.obj is buffer
    assert result.data.nbytes == size
    assert_bit_exact(result.tensors, weights)


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_shared_memory_maps_the_file_copy_on_write(client, transport):
    """No copy at all: the result maps the server's file privately; `into` is not needed, and
    writing to a result tensor changes neither the file nor later fetches."""
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    buffer = bytearray(client.latest(MODEL).byte_size)
    result = client.fetch(MODEL, transport=transport, into=memoryview(buffer))
    assert result.stats.transport == "shm"
    assert isinstance(result.data.obj, mmap.mmap) and not any(buffer)
    assert_bit_exact(result.tensors, weights)
    next(t for t in result.tensors.values() if t.dtype == torch.float32 and t.numel()).add_(1.0)
    assert_bit_exact(client.fetch(MODEL, transport=transport).tensors, weights)


# ---------------------------------------------------------------------- fallbacks
def test_shm_asked_of_a_server_without_shared_memory_streams(make_server):
    srv = make_server(shm_dir=None)
    weights = mixed_model()
    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL)
        result = c.fetch(MODEL, transport="shm")
        # The server only offers what it has: a payload description, then chunks.
        assert result.stats.transport == "stream"
        assert_bit_exact(result.tensors, weights)
        assert bytes(result.data) == bytes(c.fetch_bytes(MODEL, transport="stream").data)
        assert c.transports.usable("shm") is None  # nothing was learned about this host
        assert c.fetch(MODEL, transport="auto").stats.transport == "bulk"


def test_bulk_asked_of_a_server_without_a_bulk_port_streams(make_server):
    srv = make_server(bulk_port=None)
    weights = mixed_model()
    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL)
        result = c.fetch(MODEL, transport="bulk")
        assert result.stats.transport == "stream"
        assert_bit_exact(result.tensors, weights)
        assert c.transports.usable("bulk") is None


def test_unreadable_shm_file_falls_back_to_the_stream_and_is_not_asked_again(client, monkeypatch):
    weights = mixed_model()
    client.publish(weights, model=MODEL)

    def unreadable(self, offer, **kwargs):
        raise TransportFailed("cannot open it here")

    monkeypatch.setattr(SharedMemoryTransport, "receive", unreadable)

    result = client.fetch(MODEL, transport="auto")

    assert result.stats.transport == "stream"
    assert client.transports.usable("shm") is False
    assert_bit_exact(result.tensors, weights)
    # From now on "auto" does not ask for shared memory: the next fast path is bulk.
    assert client.fetch(MODEL, transport="auto").stats.transport == "bulk"


def test_refused_bulk_port_falls_back_to_the_stream_and_is_not_asked_again(make_server, monkeypatch):
    srv = make_server(shm_dir=None)
    weights = mixed_model()

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL, transport="stream")  # opens no bulk connection to keep
        monkeypatch.setattr(bulk_transport, "_connect", refuse)
        result = c.fetch(MODEL, transport="auto")
        assert result.stats.transport == "stream"
        assert c.transports.usable("bulk") is False
        assert_bit_exact(result.tensors, weights)
        tickets = srv.bulk.tickets
        again = c.fetch(MODEL, transport="auto")
        assert again.stats.transport == "stream"
        assert srv.bulk.tickets == tickets  # no ticket was asked for
        assert_bit_exact(again.tensors, weights)

        # The port may come back (a container restarted): after a while bulk is tried again.
        monkeypatch.undo()
        c.transports.rest_seconds = 0.0
        retried = c.fetch(MODEL, transport="auto")
        assert retried.stats.transport == "bulk" and c.transports.usable("bulk") is True
        assert_bit_exact(retried.tensors, weights)


def test_bulk_reaches_a_server_by_a_name_whose_first_address_it_does_not_listen_on(make_server, monkeypatch):
    """A host name may resolve to several addresses: "localhost" is ::1 first, then 127.0.0.1, on
    hosts whose /etc/hosts lists both (most Linux distributions, Kubernetes pods), while a server on
    0.0.0.0 (the default) listens on IPv4 only. gRPC tries each address; the bulk connection tried
    only the first, was refused, and left bulk resting: every fetch went over the stream."""
    srv = make_server(shm_dir=None)
    weights = mixed_model()
    resolve = socket.getaddrinfo

    def ipv6_first(host, port, *args, **kwargs):
        found = resolve(host, port, *args, **kwargs)
        if host == "localhost":  # as such a host answers: ::1 (nothing listens there), then 127.0.0.1
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)), *found]
        return found

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    with WeightClient(f"localhost:{srv.port}") as c:
        c.publish(weights, model=MODEL, transport="stream")
        result = c.fetch(MODEL, transport="bulk")
        assert result.stats.transport == "bulk" and c.transports.usable("bulk") is True
        assert_bit_exact(result.tensors, weights)


@pytest.mark.parametrize("damage", ["flip-byte", "truncate"])
def test_corrupt_derived_shm_file_is_detected_and_streamed_instead(server, client, damage):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    first = client.fetch(MODEL, dtype="BF16", transport="shm")
    assert first.stats.transport == "shm" and client.transports.usable("shm") is True
    expected = {name: raw(t) for name, t in first.tensors.items()}
    (path,) = [p for p in payload_files(server) if p.name.endswith("-BF16.safetensors")]

    with open(path, "r+b") as f:
        if damage == "flip-byte":
            f.seek(os.path.getsize(path) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        else:
            f.truncate(os.path.getsize(path) // 2)

    result = client.fetch(MODEL, dtype="BF16", transport="shm")
    assert result.stats.transport == "stream"
    assert client.transports.usable("shm") is False
    assert {name: raw(t) for name, t in result.tensors.items()} == expected


def test_a_version_whose_shm_file_is_damaged_is_never_served_wrong(server, client):
    """A version is received straight into its shared-memory file and served from that memory
    (no second copy), so a process that writes into the file damages the version itself. A file
    the server wrote (a publish over bulk or the stream) is read-only; if root forces a write
    anyway, every transport reports it (IntegrityError) instead of handing out wrong weights. (A
    same-host publisher's memfd is sealed: no write gets through, test_byte_ownership.)"""
    weights = mixed_model()
    client.publish(weights, model=MODEL, transport="bulk")
    (path,) = payload_files(server)
    assert os.stat(path).st_mode & 0o777 == 0o444
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    for transport in ("shm", "bulk", "stream"):
        with pytest.raises(IntegrityError):
            client.fetch(MODEL, transport=transport)


def test_servers_in_one_process_get_their_own_shm_directories(make_server):
    """Two servers on port 0 in one process (tests, an embedded server) must not share payload
    files, nor remove each other's when one stops."""
    a, b = make_server(), make_server()
    assert a.shared_memory.directory != b.shared_memory.directory
    with WeightClient(a.address) as ca, WeightClient(b.address) as cb:
        ca.publish({"w": torch.zeros(1000)}, model=MODEL)
        cb.publish({"w": torch.ones(1000)}, model=MODEL)
        b.stop(grace=0)
        assert not b.shared_memory.directory.exists()
        result = ca.fetch(MODEL, transport="shm")
        assert result.stats.transport == "shm"
        assert torch.equal(result.tensors["w"], torch.zeros(1000))


# ---------------------------------------------------------------------- bulk tickets
def test_bulk_ticket_delivers_the_payload_once(server, client):
    client.publish(mixed_model(), model=MODEL)
    version_bytes = bytes(client.fetch_bytes(MODEL, transport="stream").data)
    payload = bulk_ticket(server)
    assert payload.bulk.port == server.bulk.port and len(payload.bulk.ticket) == bulk.TICKET_BYTES

    received = redeem(payload.bulk.port, payload.bulk.ticket)
    assert received == version_bytes
    assert len(received) == payload.byte_size
    assert xxhash.xxh3_128_hexdigest(received) == payload.xxh3

    assert redeem(payload.bulk.port, payload.bulk.ticket) == b""  # single use


def test_unknown_bulk_ticket_gets_nothing(server, client):
    client.publish(mixed_model(), model=MODEL)
    payload = bulk_ticket(server)  # a ticket is pending: the random one must still not match
    assert redeem(server.bulk.port, secrets.token_bytes(bulk.TICKET_BYTES)) == b""
    assert redeem(server.bulk.port, b"") == b""  # closed before a ticket arrived
    assert redeem(server.bulk.port, payload.bulk.ticket[:8]) == b""  # half a ticket
    assert len(redeem(server.bulk.port, payload.bulk.ticket)) == payload.byte_size


def recv_exactly(conn: socket.socket, size: int) -> bytes:
    """`size` bytes from `conn`, as a client reads a bulk payload: never until the close."""
    received = bytearray()
    while len(received) < size:
        part = conn.recv(size - len(received))
        assert part, f"the server closed the connection after {len(received)} of {size} bytes"
        received += part
    return bytes(received)


def test_a_bulk_connection_is_kept_for_the_next_ticket_and_closed_on_an_unknown_one(server, client):
    """BulkTicket's contract, with a bare socket as a client written from the proto would use
    it: exactly Payload.byte_size bytes per ticket, the connection left open after each, and an
    unknown ticket answered by a close with nothing sent."""
    client.publish(mixed_model(), model=MODEL)
    first = bytes(client.fetch_bytes(MODEL, transport="stream").data)
    client.publish(layered_model(), model=MODEL)
    second = bytes(client.fetch_bytes(MODEL, transport="stream").data)
    one = bulk_ticket(server, version=1)
    two = bulk_ticket(server, version=2)
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=10) as conn:
        conn.sendall(one.bulk.ticket)
        assert recv_exactly(conn, one.byte_size) == first
        conn.settimeout(0.3)  # kept: nothing more comes, and no close
        with pytest.raises(TimeoutError):
            conn.recv(1)
        conn.settimeout(10)

        conn.sendall(two.bulk.ticket)  # the same connection carries the next ticket
        assert recv_exactly(conn, two.byte_size) == second

        conn.sendall(secrets.token_bytes(bulk.TICKET_BYTES))
        assert conn.recv(1 << 20) == b""  # closed, 0 bytes sent


def test_expired_bulk_ticket_is_refused(server, client, monkeypatch):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    monkeypatch.setattr(bulk, "TICKET_TTL_SECONDS", -1.0)
    payload = bulk_ticket(server)
    assert redeem(payload.bulk.port, payload.bulk.ticket) == b""

    # A client handed an expired ticket gets the bytes over the stream all the same.
    result = client.fetch(MODEL, transport="bulk")
    assert result.stats.transport == "stream"
    assert client.transports.usable("bulk") is False
    assert_bit_exact(result.tensors, weights)


# ---------------------------------------------------------------------- deltas
@pytest.mark.parametrize("transport", ["stream", "shm", "bulk"])
def test_delta_carries_only_the_changed_tensor(client, transport):
    v1 = layered_model()
    client.publish(v1, model=MODEL)
    base = client.fetch(MODEL, transport=transport)
    v2 = {name: t.clone() for name, t in v1.items()}
    v2["layer07.weight"] += 1
    assert client.publish(v2, model=MODEL) == 2
    full = client.fetch(MODEL, transport=transport)

    delta = client.fetch(MODEL, base=1, transport=transport)
    assert delta.stats.transport == transport
    assert (delta.version, delta.partial, delta.base_version, delta.dtype) == (2, True, 1, "")
    assert_bit_exact(delta.tensors, {"layer07.weight": v2["layer07.weight"]})
    assert delta.stats.wire_bytes * 10 <= full.stats.wire_bytes

    complete = client.fetch(MODEL, base=base, transport=transport)
    assert (complete.version, complete.partial, complete.base_version) == (2, False, 1)
    assert complete.stats.wire_bytes == delta.stats.wire_bytes
    assert_bit_exact(complete.tensors, client.fetch(MODEL, transport="stream").tensors)
    assert_bit_exact(complete.tensors, v2)


def test_delta_against_an_evicted_base_sends_everything(make_server):
    srv = make_server(keep=2)
    with WeightClient(srv.address) as c:
        versions = [layered_model(seed) for seed in range(4)]
        c.publish(versions[0], model=MODEL)
        base = c.fetch(MODEL)
        for weights in versions[1:]:
            c.publish(weights, model=MODEL)
        for given in (1, base):
            result = c.fetch(MODEL, base=given)
            assert (result.version, result.partial, result.base_version) == (4, False, 0)
            assert_bit_exact(result.tensors, versions[3])


@pytest.mark.parametrize("change", ["tensor-added", "tensor-removed", "reshaped", "dtype-changed"])
def test_delta_against_a_base_of_another_layout_sends_everything(client, change):
    v1 = layered_model(layers=5)
    client.publish(v1, model=MODEL)
    base = client.fetch(MODEL)
    v2 = {name: t.clone() for name, t in v1.items()}
    if change == "tensor-added":
        v2["extra.bias"] = torch.ones(3)
    elif change == "tensor-removed":
        del v2["layer04.weight"]
    elif change == "reshaped":
        v2["layer04.weight"] = v2["layer04.weight"].reshape(128, 128)
    else:
        v2["layer04.weight"] = v2["layer04.weight"].double()
    client.publish(v2, model=MODEL)

    for given in (1, base):
        result = client.fetch(MODEL, base=given)
        assert (result.version, result.partial, result.base_version) == (2, False, 0)
        assert_bit_exact(result.tensors, v2)


def test_delta_with_a_base_at_or_past_the_target_sends_everything(client):
    versions = [layered_model(seed, layers=4) for seed in range(3)]
    for weights in versions:
        client.publish(weights, model=MODEL)
    v2 = client.fetch(MODEL, version=2)
    for base in (2, 3, v2, client.fetch(MODEL, version=3)):
        result = client.fetch(MODEL, version=2, base=base)
        assert (result.version, result.partial, result.base_version) == (2, False, 0)
        assert_bit_exact(result.tensors, versions[1])


def test_delta_when_nothing_changed_is_empty(client):
    weights = layered_model()
    client.publish(weights, model=MODEL)
    base = client.fetch(MODEL)
    client.publish(weights, model=MODEL)

    delta = client.fetch(MODEL, base=1)
    assert (delta.version, delta.partial, delta.base_version) == (2, True, 1)
    assert delta.tensors == {}
    assert delta.stats.wire_bytes < 100

    complete = client.fetch(MODEL, base=base)
    assert (complete.version, complete.partial) == (2, False)
    assert_bit_exact(complete.tensors, weights)


def test_delta_base_checks_that_are_enforced(client):
    """A partial or cast base is refused before anything is sent; a base whose tensor dict lacks a
    tensor still holds the version's file, which the delta is rebuilt on."""
    v1 = layered_model(layers=4)
    client.publish(v1, model=MODEL)
    base = client.fetch(MODEL)
    v2 = {name: t.clone() for name, t in v1.items()}
    v2["layer01.weight"] *= 2
    client.publish(v2, model=MODEL)
    v3 = {name: t + 1 for name, t in v2.items()}
    client.publish(v3, model=MODEL)

    partial = client.fetch(MODEL, version=2, base=1)
    cast = client.fetch(MODEL, version=1, dtype="BF16")
    for bad in (partial, cast):
        with pytest.raises(InvalidRequest, match="complete result fetched without dtype"):
            client.fetch(MODEL, version=3, base=bad)
    with pytest.raises(InvalidRequest):
        client.fetch(MODEL, version=3, base=base, dtype="BF16")
    lacking = dataclasses.replace(base, tensors={k: v for k, v in base.tensors.items() if k != "layer02.weight"})
    v2_again = {name: t.clone() for name, t in v1.items()}
    v2_again["layer01.weight"] *= 2
    result = client.fetch(MODEL, version=2, base=lacking, transport="bulk")  # ("auto" here: v2 mapped whole)
    assert not result.partial and result.base_version == 1 and result.changed == ("layer01.weight",)
    assert_bit_exact(result.tensors, v2_again)


def test_delta_base_modified_in_place_is_not_merged_silently(client):
    v1 = layered_model(layers=4)
    client.publish(v1, model=MODEL)
    base = client.fetch(MODEL)
    v2 = {name: t.clone() for name, t in v1.items()}
    v2["layer01.weight"] *= 2
    client.publish(v2, model=MODEL)

    base.tensors["layer03.weight"].add_(1)  # e.g. the caller trained on it, or reused its buffer
    try:
        result = client.fetch(MODEL, base=base)
    except IntegrityError:
        return
    assert_bit_exact(result.tensors, v2)


def test_delta_base_from_another_server_incarnation_is_never_incomplete(make_server):
    old, new = make_server(), make_server()
    with WeightClient(old.address) as c_old, WeightClient(new.address) as c_new:
        c_old.publish({"a": torch.zeros(1000), "b": torch.zeros(1000)}, model=MODEL)
        base = c_old.fetch(MODEL)  # "v1" of the server before its restart
        c_new.publish({"a": torch.ones(1000), "b": torch.ones(1000)}, model=MODEL)
        v2 = {"a": torch.ones(1000), "b": torch.full((1000,), 2.0)}
        c_new.publish(v2, model=MODEL)
        try:
            result = c_new.fetch(MODEL, base=base)
        except IntegrityError:
            return
        assert not result.partial
        assert_bit_exact(result.tensors, v2)


# ---------------------------------------------------------------------- casts
@pytest.mark.parametrize("dtype", ["BF16", "F16"])
@pytest.mark.parametrize("transport", ["stream", "shm", "bulk"])
def test_cast_rounds_float32_like_torch_and_leaves_the_rest(client, dtype, transport):
    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16}[dtype]
    weights = mixed_model()
    client.publish(weights, model=MODEL)

    result = client.fetch(MODEL, dtype=dtype, transport=transport)

    assert result.stats.transport == transport
    assert (result.dtype, result.partial, result.base_version) == (dtype, False, 0)
    assert sorted(result.tensors) == sorted(weights)
    for name, source in weights.items():
        got = result.tensors[name]
        if source.dtype != torch.float32:
            assert got.dtype == source.dtype and raw(got) == raw(source), name
            continue
        want = source.to(torch_dtype)
        assert got.dtype == torch_dtype and got.shape == source.shape, name
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), name
        # NaN bits are not portable even within torch (scalar vs. vector kernels): every
        # other value must match torch's round-to-nearest-even bit for bit.
        assert raw(got[~nan]) == raw(want[~nan]), name


def test_cast_covers_the_hard_values(client):
    """The special values really exercise what they claim (guards the test above)."""
    values = special_f32()
    assert torch.isinf(values.to(torch.float16)).sum() > torch.isinf(values).sum()
    assert (values.to(torch.float16).view(torch.int16).abs() < 0x0400).any()  # f16 subnormals
    client.publish({"x": values}, model=MODEL)
    got = client.fetch(MODEL, dtype="BF16").tensors["x"]
    assert raw(got[8:10]) == raw(f32_from_bits([0x3F800000, 0x3F820000]).to(torch.bfloat16))
    assert raw(got[8:10]) == bytes.fromhex("803f823f")


def test_cast_halves_the_bytes_of_a_float32_model(client):
    client.publish(layered_model(layers=4, numel=65536), model=MODEL)
    plain = client.fetch(MODEL)
    for dtype in ("BF16", "F16"):
        cast = client.fetch(MODEL, dtype=dtype)
        assert 0.49 < cast.stats.wire_bytes / plain.stats.wire_bytes < 0.51


def test_cast_is_built_once_for_concurrent_fetchers(server, client):
    weights = mixed_model()
    client.publish(weights, model=MODEL)
    payloads = servicer_of(server).payloads
    before = payloads.builds
    barrier = threading.Barrier(4)
    results: list[bytes] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            with WeightClient(server.address) as c:
                barrier.wait(timeout=10)
                results.append(bytes(c.fetch(MODEL, dtype="BF16").data))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 4
    assert len(set(results)) == 1
    assert payloads.builds == before + 1

    assert bytes(client.fetch(MODEL, dtype="BF16", transport="stream").data) == results[0]
    assert payloads.builds == before + 1  # cached, whatever the transport
    client.fetch(MODEL, dtype="F16")
    assert payloads.builds == before + 2  # another dtype is another payload


@pytest.mark.parametrize("dtype", ["F64", "FP8", "bf16", "F32"])
def test_invalid_cast_dtype_is_an_invalid_request(client, dtype):
    client.publish(layered_model(layers=2), model=MODEL)
    for transport in ("stream", "auto"):
        with pytest.raises(InvalidRequest, match="cast"):
            client.fetch(MODEL, dtype=dtype, transport=transport)
    with grpc.insecure_channel(client.address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(pb_grpc.WeightServiceStub(channel).Fetch(pb.FetchRequest(model=MODEL, dtype=dtype), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_derived_payloads_dropped_from_a_small_cache_are_rebuilt_identically(make_server):
    srv = make_server(payload_cache_bytes=1)  # keeps only the most recent derived payload
    weights = mixed_model()
    with WeightClient(srv.address) as c:
        c.publish(weights, model=MODEL)
        payloads = servicer_of(srv).payloads
        first = {dtype: bytes(c.fetch(MODEL, dtype=dtype, transport="stream").data) for dtype in ("BF16", "F16")}
        assert payloads.keys() == [(MODEL, 1, 0, "F16", "", "")]
        for transport in ("stream", "shm", "bulk"):
            for dtype in ("BF16", "F16"):
                assert bytes(c.fetch(MODEL, dtype=dtype, transport=transport).data) == first[dtype]
        assert payloads.builds == 2 + 6
        assert len(payloads.keys()) == 1


def test_delta_and_cast_together(client):
    v1 = layered_model()
    client.publish(v1, model=MODEL)
    v2 = {name: t.clone() for name, t in v1.items()}
    v2["layer11.weight"] -= 0.5
    client.publish(v2, model=MODEL)

    result = client.fetch(MODEL, base=1, dtype="BF16")
    assert (result.version, result.partial, result.base_version, result.dtype) == (2, True, 1, "BF16")
    assert_bit_exact(result.tensors, {"layer11.weight": v2["layer11.weight"].to(torch.bfloat16)})
    assert result.stats.wire_bytes < 16384 * 2 + 200


# ---------------------------------------------------------------------- updater
class RecordingClient(WeightClient):
    """A real client that keeps every FetchResult it returned."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.results: list = []

    def fetch(self, *args, **kwargs):
        result = super().fetch(*args, **kwargs)
        if result is not None:
            self.results.append(result)
        return result


def layered_policy(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(10)])  # 20 tensors


def address_of(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("transport", ["stream", "bulk"])
def test_updater_applies_versions_bit_exactly_through_one_staging_buffer(server, client, transport):
    """Every version is received (whole) or rebuilt from a delta (on the version before) in one
    staging buffer, reused from update to update, then copied into the live parameters through
    the updater's hooks. (Over shared
    memory each version's file is mapped whole and applied zero-copy: test_zero_copy_apply.)"""
    trainer, policy = layered_policy(0), layered_policy(1)
    recording = RecordingClient(server.address)
    updater = GrpcLocalWeightUpdater(recording, policy=policy, delta=True, transport=transport)
    pointers = {name: p.data_ptr() for name, p in policy.state_dict().items()}

    client.publish(trainer, model=MODEL)
    updater()
    first = recording.results[-1]
    full_bytes = updater.last_fetch.wire_bytes
    assert not first.placed and updater.last_fetch.transport == transport
    assert_bit_exact(policy.state_dict(), trainer.state_dict())

    with torch.no_grad():
        trainer[3].weight.add_(0.25)
    client.publish(trainer, model=MODEL)
    updater()
    assert updater.version == 2
    second = recording.results[-1]  # the delta, rebuilt on the first version in the same buffer
    assert not second.partial and second.base_version == 1 and second.changed == ("3.weight",)
    assert updater.last_fetch.wire_bytes * 10 <= full_bytes
    assert_bit_exact(policy.state_dict(), trainer.state_dict())
    assert address_of(recording.results[-1].data) == address_of(first.data)

    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1)  # every tensor changes: the server sends the version's own file
    client.publish(trainer, model=MODEL)
    updater()
    third = recording.results[-1]
    assert updater.version == 3 and updater.last_fetch.wire_bytes >= full_bytes
    assert third.base_version == 0 and not third.partial
    assert_bit_exact(policy.state_dict(), trainer.state_dict())
    assert {name: p.data_ptr() for name, p in policy.state_dict().items()} == pointers
    assert address_of(third.data) == address_of(first.data)
    recording.close()


def test_updater_with_bf16_ends_on_the_rounded_weights(server, client):
    trainer, policy = layered_policy(0), layered_policy(1)
    updater = GrpcLocalWeightUpdater(server.address, policy=policy, delta=True, dtype="BF16")
    try:
        client.publish(trainer, model=MODEL)
        updater()
        expected = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in trainer.state_dict().items()}
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        assert_bit_exact(policy.state_dict(), expected)
        full = updater.last_fetch.wire_bytes

        with torch.no_grad():
            trainer[5].bias.add_(1.0)
        client.publish(trainer, model=MODEL)
        updater()
        assert updater.version == 2 and updater.last_fetch.wire_bytes * 10 <= full
        expected = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in trainer.state_dict().items()}
        assert_bit_exact(policy.state_dict(), expected)
    finally:
        updater.client.close()


# ---------------------------------------------------------------------- shm files
def test_shm_files_go_with_their_version_and_the_directory_with_the_server(make_server):
    srv = make_server(keep=1)
    directory = srv.shared_memory.directory
    with WeightClient(srv.address) as c:
        c.publish(layered_model(0, layers=3), model=MODEL)
        assert c.fetch(MODEL, transport="shm").stats.transport == "shm"
        assert c.fetch(MODEL, dtype="BF16", transport="shm").stats.transport == "shm"
        v1_files = payload_files(srv)
        assert [p.name for p in v1_files] == ["000000000001-BF16.safetensors", "000000000001.safetensors"]

        c.publish(layered_model(1, layers=3), model=MODEL)
        assert not any(p.exists() for p in v1_files)
        assert [p.name for p in payload_files(srv)] == ["000000000002.safetensors"]
        assert c.fetch(MODEL, transport="shm").stats.transport == "shm"
    srv.stop(grace=0)
    assert not directory.exists()


def test_shm_files_go_when_their_version_is_deleted(server, client):
    client.publish(layered_model(0, layers=3), model=MODEL)
    client.publish(layered_model(1, layers=3), model=MODEL)
    client.fetch(MODEL, version=1, dtype="BF16", transport="shm")
    client.delete(MODEL, 1)
    assert [p.name for p in payload_files(server)] == ["000000000002.safetensors"]


# ---------------------------------------------------------------------- wire format
@pytest.mark.parametrize("chunk_size", [0, 64 * 1024, 3 * 1024 * 1024])
@pytest.mark.parametrize("derived", [False, True])
def test_hand_framed_chunk_messages_are_valid_protobuf(server, client, chunk_size, derived):
    client.publish(layered_model(0), model=MODEL)
    client.publish(mixed_model(), model=MODEL)
    request = pb.FetchRequest(model=MODEL, chunk_size=chunk_size)
    if derived:
        request.base_version = 1
        request.dtype = "BF16"

    raw_messages = raw_fetch(server.address, request)
    messages = [pb.FetchResponse.FromString(m) for m in raw_messages]
    assert [m.SerializeToString() for m in messages] == raw_messages  # canonical encoding
    kinds = [m.WhichOneof("kind") for m in messages]
    expected_head = ["header", "payload"] if derived else ["header"]
    assert kinds[: len(expected_head)] == expected_head
    assert set(kinds[len(expected_head) :]) == {"chunk"}
    chunks = [m.chunk for m in messages[len(expected_head) :]]
    limit = chunk_size or 1024 * 1024
    assert all(len(c) <= limit for c in chunks) and all(len(c) == limit for c in chunks[:-1])
    body = b"".join(chunks)
    if derived:
        payload = messages[1].payload
        assert (payload.base_version, payload.dtype) == (0, "BF16")  # layouts differ: a full cast
        assert not payload.HasField("shared_memory") and not payload.HasField("bulk")
        assert len(body) == payload.byte_size and xxhash.xxh3_128_hexdigest(body) == payload.xxh3
        assert body == bytes(client.fetch_bytes(MODEL, dtype="BF16", transport="stream").data)
    else:
        assert body == bytes(client.fetch_bytes(MODEL, transport="stream").data)

    with grpc.insecure_channel(server.address) as channel:
        parsed = list(pb_grpc.WeightServiceStub(channel).Fetch(request, timeout=30))
    assert [m.SerializeToString() for m in parsed] == raw_messages


def test_hand_framed_delta_chunks_parse_with_the_generated_stub(server, client):
    v1 = layered_model()
    client.publish(v1, model=MODEL)
    v2 = {name: t.clone() for name, t in v1.items()}
    v2["layer00.weight"] += 3
    client.publish(v2, model=MODEL)
    request = pb.FetchRequest(model=MODEL, base_version=1)
    with grpc.insecure_channel(server.address) as channel:
        messages = list(pb_grpc.WeightServiceStub(channel).Fetch(request, timeout=30))
    assert [m.WhichOneof("kind") for m in messages] == ["header", "payload", "chunk"]
    assert messages[1].payload.base_version == 1 and messages[1].payload.dtype == ""
    assert messages[2].chunk == bytes(client.fetch_bytes(MODEL, base_version=1, transport="stream").data)


def test_bulk_connection_is_kept_and_replaced_when_the_server_closed_it(make_server, monkeypatch):
    srv = make_server(shm_dir=None)
    weights = mixed_model()
    with WeightClient(srv.address) as client:
        client.publish(weights, model=MODEL, transport="stream")
        kept = client.transports.by_name["bulk"]
        for _ in range(3):
            assert client.fetch(MODEL, transport="bulk").stats.transport == "bulk"
            assert kept.connected and srv.bulk.connections == 1  # one connection for many transfers
        # The server drops the kept connection (its idle limit): the next transfer notices,
        # connects afresh and still delivers.
        monkeypatch.setattr(bulk, "IDLE_CONNECTION_SECONDS", 0.3)
        client.fetch(MODEL, transport="bulk")
        wait_until(lambda: srv.bulk.connections == 0, timeout=5)
        result = client.fetch(MODEL, transport="bulk")
        assert result.stats.transport == "bulk" and kept.connected and srv.bulk.connections == 1
        assert_bit_exact(result.tensors, weights)
