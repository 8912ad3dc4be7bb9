"""Every row of the error table against a real server.

Each case checks (a) the weightclient exception class, (b) the gRPC status code and the
"weightserver-error" trailer on the wire, (c) that the message says what is wrong or what
exists, and then that the failed call left nothing behind: the latest version is unchanged and
another client still fetches the last good version.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch

from weightclient import (
    CursorOutOfRange,
    IntegrityError,
    InvalidModelName,
    InvalidRequest,
    InvalidSafetensors,
    ModelNotFound,
    ModelTooLarge,
    VersionConflict,
    VersionEvicted,
    VersionNotFound,
    WeightClient,
    WeightServerError,
)
from weightclient import tensors as tensor_codec
from weightclient.core.failover import error_from_rpc
from weightserver.protocol.errors import ERROR_METADATA_KEY, clipped_repr
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
GOOD = {
    1: {"w": torch.full((64,), 1.0), "b": torch.arange(4)},
    2: {"w": torch.full((64,), 2.0), "b": torch.arange(4) * 2},
}


# ---------------------------------------------------------------------- helpers
def file_bytes(weights) -> bytes:
    return b"".join(bytes(p) for p in tensor_codec.encode(weights))


def safetensors_file(header: bytes | dict, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def rpc_error_of(error: WeightServerError) -> grpc.RpcError:
    """The grpc.RpcError the client translated (kept as the exception's __context__)."""
    context = error.__context__
    assert isinstance(context, grpc.RpcError), f"{error!r} does not chain the grpc error"
    return context


def error_name(rpc_error: grpc.RpcError) -> str | None:
    return dict(rpc_error.trailing_metadata() or ()).get(ERROR_METADATA_KEY)


@contextmanager
def raises_rpc(
    exc_type: type[WeightServerError], code: grpc.StatusCode, *fragments: str
) -> Iterator[pytest.ExceptionInfo]:
    """Expect exactly `exc_type` from the client, `code` on the wire, `fragments` in the message."""
    with pytest.raises(WeightServerError) as info:
        yield info
    error = info.value
    assert type(error) is exc_type, f"expected {exc_type.__name__}, got {type(error).__name__}: {error}"
    rpc_error = rpc_error_of(error)
    assert rpc_error.code() == code
    assert error_name(rpc_error) == exc_type.__name__
    message = str(error)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@contextmanager
def raw_raises(
    exc_type: type[WeightServerError], code: grpc.StatusCode, *fragments: str
) -> Iterator[pytest.ExceptionInfo]:
    """Like raises_rpc, for calls made on a raw stub (the client's mapping is applied here)."""
    with pytest.raises(grpc.RpcError) as info:
        yield info
    rpc_error = info.value
    assert rpc_error.code() == code, rpc_error.details()
    assert error_name(rpc_error) == exc_type.__name__
    assert type(error_from_rpc(rpc_error)) is exc_type
    for fragment in fragments:
        assert fragment in rpc_error.details(), f"{fragment!r} not in {rpc_error.details()!r}"


def assert_last_good(other: WeightClient, model: str, version: int, weights: dict[str, torch.Tensor]) -> None:
    """The latest version is still `version` and another client fetches it intact."""
    assert other.latest(model).version == version
    result = other.fetch(model)
    assert result is not None
    assert result.version == version
    fetched = result.state_dict()
    assert set(fetched) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(fetched[name], tensor)
    exact = other.fetch(model, version=version)
    assert exact is not None
    assert exact.info.xxh3 == result.info.xxh3


@pytest.fixture
def published(client: WeightClient) -> int:
    """Versions 1 and 2 of MODEL; returns the latest (2)."""
    for version, weights in GOOD.items():
        assert client.publish(weights, model=MODEL) == version
    return 2


@pytest.fixture
def stub(server) -> Iterator[pb_grpc.WeightServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.WeightServiceStub(channel)


@pytest.fixture
def pair(make_server):
    """(server factory returning (server, client, other_client)) for custom settings."""
    clients: list[WeightClient] = []

    def factory(**settings):
        srv = make_server(**settings)
        a, b = WeightClient(srv.address), WeightClient(srv.address)
        clients.extend((a, b))
        return srv, a, b

    yield factory
    for c in clients:
        c.close()


def header_request(model: str, data: bytes, *, total_bytes: int | None = None, sha256: str | None = None):
    return pb.PublishRequest(
        header=pb.PublishHeader(
            model=model,
            total_bytes=len(data) if total_bytes is None else total_bytes,
            sha256=hashlib.sha256(data).hexdigest() if sha256 is None else sha256,
        )
    )


def chunks(data: bytes, size: int = 64 * 1024) -> list[pb.PublishRequest]:
    return [pb.PublishRequest(chunk=data[i : i + size]) for i in range(0, len(data), size)]


def commit(*sha256: str) -> pb.PublishRequest:
    return pb.PublishRequest(commit=pb.PublishCommit(sha256=list(sha256)))


# ---------------------------------------------------------------------- NOT_FOUND
def test_unknown_model(client, other_client, published) -> None:
    with raises_rpc(ModelNotFound, grpc.StatusCode.NOT_FOUND, "'ghost'", "models: 'policy'"):
        client.fetch("ghost")
    with raises_rpc(ModelNotFound, grpc.StatusCode.NOT_FOUND, "'ghost'", "'policy'"):
        client.latest("ghost")
    with raises_rpc(ModelNotFound, grpc.StatusCode.NOT_FOUND, "'ghost'", "'policy'"):
        client.describe("ghost", 1)
    with raises_rpc(ModelNotFound, grpc.StatusCode.NOT_FOUND, "'ghost'", "'policy'"):
        client.fetch("ghost", newer_than=0)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_unknown_model_on_empty_server(client, other_client) -> None:
    with raises_rpc(ModelNotFound, grpc.StatusCode.NOT_FOUND, "'ghost'", "none yet"):
        client.fetch("ghost")
    assert other_client.list_models() == []


def test_unknown_version(client, other_client, published) -> None:
    with raises_rpc(VersionNotFound, grpc.StatusCode.NOT_FOUND, "no version 99", "retained versions: 1-2"):
        client.fetch(MODEL, version=99)
    with raises_rpc(VersionNotFound, grpc.StatusCode.NOT_FOUND, "no version 7", "retained versions: 1-2"):
        client.describe(MODEL, 7)
    with raises_rpc(VersionNotFound, grpc.StatusCode.NOT_FOUND, "retained versions: 1-2"):
        client.delete(MODEL, 5)
    with raises_rpc(VersionNotFound, grpc.StatusCode.NOT_FOUND, "retained versions: 1-2"):
        client.pin(MODEL, 5)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_deleted_version(client, other_client, published) -> None:
    client.delete(MODEL, 1)
    with raises_rpc(VersionNotFound, grpc.StatusCode.NOT_FOUND, "version 1 was deleted", "retained versions: 2"):
        client.fetch(MODEL, version=1)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_evicted_version(pair) -> None:
    _, client, other = pair(keep=2)
    for i in range(1, 4):
        client.publish({"w": torch.full((8,), float(i))}, model=MODEL)
    with raises_rpc(VersionEvicted, grpc.StatusCode.NOT_FOUND, "version 1", "oldest retained is 2", "2-3"):
        client.fetch(MODEL, version=1)
    with raises_rpc(VersionEvicted, grpc.StatusCode.NOT_FOUND, "oldest retained is 2"):
        client.describe(MODEL, 1)
    assert_last_good(other, MODEL, 3, {"w": torch.full((8,), 3.0)})
    assert other.fetch(MODEL, version=2) is not None


# ---------------------------------------------------------------------- INVALID_ARGUMENT: safetensors
MALFORMED = {
    "bad_json": (safetensors_file(b'{"w": {"dtype": "F32",   '), "not valid JSON"),
    "not_an_object": (safetensors_file(b"[1, 2, 3]"), "must be a JSON object"),
    "unknown_dtype": (
        safetensors_file({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        "unknown dtype 'F7'",
    ),
    "offsets_out_of_bounds": (
        safetensors_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
        "run past the 4-byte data section",
    ),
    "overlapping_offsets": (
        safetensors_file(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
        ),
        "overlap",
    ),
    "shape_not_matching_bytes": (
        safetensors_file({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "shape [3] of F32 needs 12 bytes",
    ),
    "header_past_end": (struct.pack("<Q", 1000) + b"{}", "runs past the end"),
    "too_short": (b"\1\0\0", "8-byte header length"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_safetensors(client, other_client, published, case: str) -> None:
    data, fragment = MALFORMED[case]
    with raises_rpc(InvalidSafetensors, grpc.StatusCode.INVALID_ARGUMENT, fragment):
        client.publish_bytes(MODEL, data)
    assert_last_good(other_client, MODEL, published, GOOD[2])
    # A failed publish takes no version number.
    assert client.publish({"w": torch.zeros(2)}, model=MODEL) == published + 1


# ---------------------------------------------------------------------- DATA_LOSS
def test_fewer_bytes_than_declared(stub, other_client, published) -> None:
    data = file_bytes({"w": torch.randn(100_000)})
    requests = [header_request(MODEL, data), *chunks(data[:-100]), commit()]
    with raw_raises(
        IntegrityError, grpc.StatusCode.DATA_LOSS, f"declared {len(data)} bytes", f"sent {len(data) - 100}"
    ):
        stub.Publish(iter(requests), timeout=10)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_more_bytes_than_declared(stub, other_client, published) -> None:
    data = file_bytes({"w": torch.randn(100_000)})
    requests = [header_request(MODEL, data, total_bytes=len(data) - 8), *chunks(data), commit()]
    with raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, f"declared {len(data) - 8} bytes but sent more"):
        stub.Publish(iter(requests), timeout=10)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_digest_mismatch(client, other_client, published) -> None:
    data = file_bytes({"w": torch.randn(1000)})
    wrong = "0" * 64
    actual = hashlib.sha256(data).hexdigest()
    with raises_rpc(IntegrityError, grpc.StatusCode.DATA_LOSS, "sha256", actual, wrong):
        client.publish_bytes(MODEL, data, sha256=wrong)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_digest_mismatch_raw(stub, other_client, published) -> None:
    data = bytearray(file_bytes({"w": torch.randn(1000)}))
    digest = hashlib.sha256(data).hexdigest()
    data[-1] ^= 0xFF  # corrupted "in transit"
    requests = [header_request(MODEL, bytes(data), sha256=digest), *chunks(bytes(data)), commit()]
    with raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, digest, "corrupted"):
        stub.Publish(iter(requests), timeout=10)
    assert_last_good(other_client, MODEL, published, GOOD[2])


# ---------------------------------------------------------------------- RESOURCE_EXHAUSTED
def test_over_max_model_bytes(pair) -> None:
    _, client, other = pair(max_model_bytes=4096)
    small = {"w": torch.ones(16)}
    client.publish(small, model=MODEL)
    big = {"w": torch.ones(2048)}  # 8 KiB of data
    size = len(file_bytes(big))
    with raises_rpc(ModelTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{size} bytes", "limit of 4096 bytes"):
        client.publish(big, model=MODEL)
    assert_last_good(other, MODEL, 1, small)


# ---------------------------------------------------------------------- FAILED_PRECONDITION
@pytest.mark.parametrize("requested", [1, 2])
def test_version_not_greater_than_latest(client, other_client, published, requested: int) -> None:
    with raises_rpc(
        VersionConflict,
        grpc.StatusCode.FAILED_PRECONDITION,
        f"requested version {requested}",
        "latest version 2",
        "version > 2",
    ):
        client.publish({"w": torch.zeros(64), "b": torch.arange(4)}, model=MODEL, version=requested)
    assert_last_good(other_client, MODEL, published, GOOD[2])
    assert client.publish({"w": torch.zeros(1)}, model=MODEL, version=10) == 10


def test_version_of_deleted_latest_cannot_be_reused(client, other_client, published) -> None:
    client.delete(MODEL, 2)
    with raises_rpc(VersionConflict, grpc.StatusCode.FAILED_PRECONDITION, "latest version 2"):
        client.publish({"w": torch.zeros(1)}, model=MODEL, version=2)
    assert_last_good(other_client, MODEL, 1, GOOD[1])


# ---------------------------------------------------------------------- INVALID_ARGUMENT: names, requests
@pytest.mark.parametrize(
    "name", ["", "a/b", "..", "../etc", ".hidden", "-x", "a..b", "x" * 129, "sp ace"], ids=lambda n: repr(n[:12])
)
def test_invalid_model_name(client, other_client, published, name: str) -> None:
    quoted = f"invalid model name {clipped_repr(name)}"  # long names cut to their first 100 characters
    with raises_rpc(InvalidModelName, grpc.StatusCode.INVALID_ARGUMENT, quoted, "A-Z a-z 0-9"):
        client.publish({"w": torch.zeros(1)}, model=name)
    with raises_rpc(InvalidModelName, grpc.StatusCode.INVALID_ARGUMENT, quoted):
        client.fetch(name)
    with raises_rpc(InvalidModelName, grpc.StatusCode.INVALID_ARGUMENT, quoted):
        client.latest(name)
    with raises_rpc(InvalidModelName, grpc.StatusCode.INVALID_ARGUMENT, quoted):
        next(iter(client.watch(name, timeout=5)))
    assert [m.model for m in other_client.list_models()] == [MODEL]
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_publish_stream_starting_with_a_chunk(stub, other_client, published) -> None:
    data = file_bytes({"w": torch.zeros(4)})
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "must start with a header"):
        stub.Publish(iter([*chunks(data), header_request(MODEL, data)]), timeout=10)
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "must start with a header"):
        stub.Publish(iter([]), timeout=10)
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "'policy' appears twice"):
        stub.Publish(
            iter([header_request(MODEL, data), header_request(MODEL, data), *chunks(data), commit()]), timeout=10
        )
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "sha256"):
        stub.Publish(iter([header_request(MODEL, data, sha256=""), *chunks(data), commit()]), timeout=10)
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "nothing may follow the commit"):
        stub.Publish(iter([header_request(MODEL, data), *chunks(data), commit(), *chunks(data)]), timeout=10)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_publish_stream_without_commit_publishes_nothing(stub, other_client, published) -> None:
    """Every byte, right size and digest, but no commit message: a publisher that stopped early."""
    data = file_bytes({"w": torch.randn(1000)})
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "without a commit message", "nothing"):
        stub.Publish(iter([header_request(MODEL, data), *chunks(data)]), timeout=10)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_digest_may_come_with_the_commit(stub, other_client, published) -> None:
    data = file_bytes({"w": torch.arange(10.0)})
    digest = hashlib.sha256(data).hexdigest()
    reply = stub.Publish(iter([header_request(MODEL, data, sha256=""), *chunks(data), commit(digest)]), timeout=10)
    assert reply.version.version == published + 1 and reply.version.sha256 == digest
    with raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, "header declares sha256", "0" * 64):
        stub.Publish(iter([header_request(MODEL, data), *chunks(data), commit("0" * 64)]), timeout=10)
    assert other_client.latest(MODEL).version == published + 1


def test_fetch_version_zero_is_invalid_while_describe_reads_zero_as_latest(stub, other_client, published) -> None:
    """The difference the proto documents: FetchRequest.version sits in a oneof, so a 0 that
    was set is told apart from none (INVALID_ARGUMENT); DescribeRequest.version has no such
    presence, and 0 there is the latest. A Fetch with no selector is the latest."""
    with raw_raises(InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 1"):
        list(stub.Fetch(pb.FetchRequest(model=MODEL, version=0), timeout=10))
    assert stub.Describe(pb.DescribeRequest(model=MODEL, version=0), timeout=10).version == published
    assert stub.Describe(pb.DescribeRequest(model=MODEL), timeout=10).version == published
    assert next(stub.Fetch(pb.FetchRequest(model=MODEL), timeout=10)).header.version == published
    assert stub.Describe(pb.DescribeRequest(model=MODEL, version=1), timeout=10).version == 1
    assert_last_good(other_client, MODEL, published, GOOD[2])


# ---------------------------------------------------------------------- OUT_OF_RANGE
def test_newer_than_ahead_of_latest(client, other_client, published) -> None:
    with raises_rpc(CursorOutOfRange, grpc.StatusCode.OUT_OF_RANGE, "version 5", "latest version 2"):
        client.fetch(MODEL, newer_than=5)
    assert_last_good(other_client, MODEL, published, GOOD[2])


def test_watch_since_ahead_of_latest(client, other_client, published) -> None:
    events = client.watch(MODEL, since=3, timeout=10)
    with raises_rpc(CursorOutOfRange, grpc.StatusCode.OUT_OF_RANGE, "since=3", "latest version 2", "since=0"):
        next(events)
    assert_last_good(other_client, MODEL, published, GOOD[2])


# ---------------------------------------------------------------------- cancelled publishes
def watch_publish_start(server) -> threading.Event:
    """Set when the server has read a Publish header (it is then in the middle of a publish)."""
    started = threading.Event()
    check_publish = server.store.check_publish

    def instrumented(*args, **kwargs):
        started.set()
        return check_publish(*args, **kwargs)

    server.store.check_publish = instrumented
    return started


@pytest.fixture
def publish_started(server) -> threading.Event:
    return watch_publish_start(server)


def test_cancel_mid_publish_leaves_no_version(stub, client, other_client, published, publish_started) -> None:
    data = file_bytes({"w": torch.randn(300_000)})  # ~1.2 MiB: many chunks
    sent_all = threading.Event()
    release = threading.Event()

    def requests():
        # Every byte of a valid file with the right size and digest, but the stream is never
        # closed: only the end of the stream may commit, and the call is cancelled first.
        yield header_request(MODEL, data)
        yield from chunks(data)
        sent_all.set()
        release.wait(10)

    future = stub.Publish.future(requests(), timeout=30)
    try:
        assert publish_started.wait(10)
        assert sent_all.wait(10)
        assert future.cancel()
    finally:
        release.set()
    assert future.cancelled()
    assert future.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.FutureCancelledError):
        future.result()

    assert [v.version for v in other_client.list_versions(MODEL)] == [1, 2]
    assert_last_good(other_client, MODEL, published, GOOD[2])
    # The cancelled publish took no version number.
    assert client.publish({"w": torch.zeros(1)}, model=MODEL) == published + 1


def test_request_generator_failing_mid_publish_leaves_no_version(
    stub, client, other_client, published, publish_started
) -> None:
    data = file_bytes({"w": torch.randn(300_000)})
    all_chunks = chunks(data)
    server_was_publishing: list[bool] = []

    def requests():
        yield header_request(MODEL, data)
        yield from all_chunks[: len(all_chunks) // 2]
        server_was_publishing.append(publish_started.wait(10))
        raise RuntimeError("trainer crashed while uploading")

    with pytest.raises(grpc.RpcError) as info:
        stub.Publish(requests(), timeout=30)
    assert server_was_publishing == [True]
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    assert error_name(info.value) is None  # cut off by the client, not rejected by the server

    assert [v.version for v in other_client.list_versions(MODEL)] == [1, 2]
    assert_last_good(other_client, MODEL, published, GOOD[2])
    assert client.publish({"w": torch.zeros(1)}, model=MODEL) == published + 1


def test_client_deadline_mid_publish_leaves_no_version(stub, client, other_client, published) -> None:
    data = file_bytes({"w": torch.randn(1000)})
    release = threading.Event()

    def requests():
        yield header_request(MODEL, data)
        yield from chunks(data)
        release.wait(10)  # never closes the stream before the deadline

    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.Publish(requests(), timeout=0.5)
    finally:
        release.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_last_good(other_client, MODEL, published, GOOD[2])
    assert client.publish({"w": torch.zeros(1)}, model=MODEL) == published + 1
