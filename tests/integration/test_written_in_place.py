"""A same-host publisher writes its shared-memory upload in place and may say how far it has got
(`PublishWritten`, issue 15: progress; the server reads nothing before its seal at `uploaded`,
issue 29). The digest then comes with `uploaded`. Every message out of order, and every way such
a publish can stop half-way, is refused here over real gRPC: none ever makes a version visible
or leaves its file behind."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch
import xxhash

from tests.integration.test_fast_paths import mixed_model
from tests.integration.test_publish_transports import (
    BULK,
    MODEL,
    SHM,
    assert_nothing_visible,
    file_of,
    identity_of,
    negotiate_publish,
    released,
)
from tests.waiting import wait_until
from weightclient import WeightClient
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc


def written(upload: str, end: int) -> pb.PublishRequest:
    return pb.PublishRequest(written=pb.PublishWritten(upload=upload, end=end))


def uploaded(upload: str, xxh3: str = "") -> pb.PublishRequest:
    return pb.PublishRequest(uploaded=pb.PublishUploaded(upload=upload, xxh3=xxh3))


def publish(address: str, messages: list[pb.PublishRequest]) -> pb.PublishResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WeightServiceStub(channel).Publish(iter(messages), timeout=30)


def staged_shm(address: str, data: bytes) -> tuple[pb.PublishHeader, pb.NegotiateResponse]:
    """A header without a digest, and a shared-memory upload for it, `data` written into it."""
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(address, [SHM], header)
    assert answer.transport == SHM
    with open(answer.payload.shared_memory.path, "r+b") as f:
        f.write(data)
    return header, answer


def test_bytes_announced_as_written_are_verified_and_committed(server, client):
    data = file_of(mixed_model())
    header, answer = staged_shm(server.address, data)
    identity = identity_of(answer.payload.shared_memory.path)
    third = len(data) // 3
    messages = [
        pb.PublishRequest(header=header),
        written(answer.upload, third),
        written(answer.upload, third),  # saying the same again is no error
        written(answer.upload, 2 * third),
        uploaded(answer.upload, xxhash.xxh3_128_hexdigest(data)),
        pb.PublishRequest(commit=pb.PublishCommit()),
    ]
    reply = publish(server.address, messages)
    assert reply.version.version == 1 and reply.version.xxh3 == xxhash.xxh3_128_hexdigest(data)
    version_file = server.shared_memory.directory / MODEL / f"{1:012d}.safetensors"
    assert identity_of(version_file) == identity  # the upload is the version's file
    assert client.fetch_bytes(MODEL, transport="stream").data.tobytes() == data


@pytest.mark.parametrize(
    ("build", "code", "text"),
    [
        # `end` going back, or beyond the size.
        (lambda u, n, x: [written(u, n // 2), written(u, n // 4)], "INVALID_ARGUMENT", "must not go back"),
        (lambda u, n, x: [written(u, n + 1)], "INVALID_ARGUMENT", "beyond the size"),
        # Two ways of moving one model's bytes.
        (lambda u, n, x: [written(u, n // 2), pb.PublishRequest(chunk=b"x")], "INVALID_ARGUMENT", "one or the other"),
        (lambda u, n, x: [uploaded(u, x), written(u, n)], "INVALID_ARGUMENT", "after another upload or its"),
        (lambda u, n, x: [written(u, n // 2), uploaded("0" * 32, x)], "INVALID_ARGUMENT", "chunks or one"),
        # The digest, when only `uploaded` brings it, is checked like any other.
        (lambda u, n, x: [written(u, n // 2), uploaded(u, "0" * 32)], "DATA_LOSS", "xxh3"),
        # No digest anywhere.
        (lambda u, n, x: [written(u, n // 2), uploaded(u)], "INVALID_ARGUMENT", "give the xxh3"),
    ],
    ids=["goes-back", "beyond-size", "then-chunks", "after-uploaded", "other-upload", "wrong-xxh3", "no-digest"],
)
def test_written_out_of_order_is_refused_and_leaves_nothing(server, client, build, code, text):
    client.publish(mixed_model(1), model=MODEL, transport="stream")
    data = file_of(mixed_model(2))
    header, answer = staged_shm(server.address, data)
    identity = identity_of(answer.payload.shared_memory.path)
    middle = build(answer.upload, len(data), xxhash.xxh3_128_hexdigest(data))
    messages = [pb.PublishRequest(header=header), *middle, pb.PublishRequest(commit=pb.PublishCommit())]
    with pytest.raises(grpc.RpcError) as caught:
        publish(server.address, messages)
    assert caught.value.code() == getattr(grpc.StatusCode, code) and text in caught.value.details()
    assert_nothing_visible(client, 1)
    assert released(answer.payload.shared_memory.path, identity)


def test_an_xxh3_in_the_header_and_another_in_uploaded_is_data_loss(server, client):
    data = file_of(mixed_model())
    header, answer = staged_shm(server.address, data)
    header.xxh3 = xxhash.xxh3_128_hexdigest(data)
    messages = [
        pb.PublishRequest(header=header),
        uploaded(answer.upload, xxhash.xxh3_128_hexdigest(data + b"x")),
        pb.PublishRequest(commit=pb.PublishCommit()),
    ]
    with pytest.raises(grpc.RpcError) as caught:
        publish(server.address, messages)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "`uploaded` declares" in caught.value.details()
    assert not client.list_models()


def test_written_is_only_for_a_shared_memory_upload(server, client):
    data = file_of(mixed_model())
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(server.address, [BULK], header)
    assert answer.transport == BULK
    commit = pb.PublishRequest(commit=pb.PublishCommit())
    messages = [pb.PublishRequest(header=header), written(answer.upload, 10), commit]
    with pytest.raises(grpc.RpcError) as caught:
        publish(server.address, messages)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is bulk" in caught.value.details()
    assert not client.list_models()


def test_a_malformed_file_announced_as_written_is_refused(server, client):
    data = b"\xff" * 8 + b"x" * (4 << 20)  # a header length far past the end
    header, answer = staged_shm(server.address, data)
    identity = identity_of(answer.payload.shared_memory.path)
    messages = [
        pb.PublishRequest(header=header),
        written(answer.upload, 1 << 20),
        uploaded(answer.upload, xxhash.xxh3_128_hexdigest(data)),
        pb.PublishRequest(commit=pb.PublishCommit()),
    ]
    with pytest.raises(grpc.RpcError) as caught:
        publish(server.address, messages)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in caught.value.details()
    assert not client.list_models()
    assert released(answer.payload.shared_memory.path, identity)


@pytest.mark.parametrize("how", ["no-uploaded", "cancelled"])
def test_a_writer_that_stops_half_way_commits_nothing_and_leaves_no_file(server, client, how):
    client.publish(mixed_model(1), model=MODEL, transport="stream")
    data = file_of(mixed_model(2))
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(server.address, [SHM], header)
    path = answer.payload.shared_memory.path
    identity = identity_of(path)

    def messages() -> Iterator[pb.PublishRequest]:
        with open(path, "r+b") as f:
            f.write(data[: len(data) // 2])
        yield pb.PublishRequest(header=header)
        yield written(answer.upload, len(data) // 2)
        if how == "cancelled":
            time.sleep(0.2)
            raise RuntimeError("the trainer crashed")  # grpc cancels the call
        yield pb.PublishRequest(commit=pb.PublishCommit())

    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.WeightServiceStub(channel).Publish(messages(), timeout=30)
    if how == "no-uploaded":
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "was cut short" in caught.value.details()
    else:
        assert caught.value.code() == grpc.StatusCode.UNKNOWN  # grpc's word for a request iterator that raised
    wait_until(lambda: released(path, identity), timeout=10, step=0.01)
    assert_nothing_visible(client, 1)


def test_a_client_publish_written_in_place_is_bit_exact(server, client):
    """WeightClient's own shared-memory publish, of a model large enough for several words
    (that it sends them: test_cut_through's watchers hear of such a publish before its commit)."""
    weights = {"w": torch.arange(6 << 20, dtype=torch.float32), "b": torch.arange(7, dtype=torch.int64)}
    versions = [client.publish(weights, model=MODEL, transport="shm") for _ in range(2)]  # then the spare
    assert versions == [1, 2]
    with WeightClient(server.address) as other:
        fetched = other.fetch(MODEL, version=2, transport="stream").state_dict()
    assert fetched["w"].equal(weights["w"]) and fetched["b"].equal(weights["b"])
