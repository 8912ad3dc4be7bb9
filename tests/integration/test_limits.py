"""Server limits: how long a publish may take, how many calls one connection may hold, what a
thousand idle watchers cost, and how large a version's description may grow (issue 14, item 3:
every version the server commits can be described to a gRPC client with default settings)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from weightclient import DescriptionTooLarge, InvalidSafetensors, WeightClient, WeightServiceClient
from weightserver.protocol.limits import MAX_DESCRIPTION_BYTES, PUBLISH_MAX_TENSORS
from weightserver.protocol.safetensors_format import build_header
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
MiB = 1024 * 1024


def test_a_stalled_publish_is_dropped_after_the_publish_timeout(make_server):
    server = make_server(publish_timeout=0.5, shm_dir=None)
    with WeightClient(server.address) as client:
        client.publish({"w": torch.ones(4)}, model=MODEL)

        def stalled():
            yield pb.PublishRequest(header=pb.PublishHeader(model=MODEL, total_bytes=1 << 20))
            yield pb.PublishRequest(chunk=b"\0" * 1024)
            time.sleep(3.0)  # a publisher that hangs half-way (or a slow-loris client)

        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                stub.Publish(stalled(), timeout=30)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--publish-timeout" in caught.value.details() and "nothing was published" in caught.value.details()
            assert time.monotonic() - started < 3.0  # the server ended it, not the client's own deadline
        assert client.latest(MODEL).version == 1
        assert torch.equal(client.fetch(MODEL).tensors["w"], torch.ones(4))


def test_publish_timeout_is_a_serve_flag_and_can_be_turned_off():
    from weightserver import ServerConfig
    from weightserver.cli import build_parser

    args = build_parser().parse_args(["serve", "--publish-timeout", "0"])
    assert args.publish_timeout == 0
    assert ServerConfig(publish_timeout=None).publish_timeout is None
    with pytest.raises(ValueError, match="publish_timeout"):
        ServerConfig(publish_timeout=-1)


@pytest.mark.parametrize("option", ["--publish-timeout", "--grace"])
def test_a_time_limit_that_is_not_a_number_is_refused(option):
    """`serve --publish-timeout nan` (argparse's float takes it) is refused as -1 is. Before, NaN
    passed every `< 0` check: a server whose every publish ended DEADLINE_EXCEEDED ("longer than
    the server's limit of nans"), or whose shutdown grace was no number of seconds."""
    from weightserver.cli import build_parser, server_config

    with pytest.raises(ValueError, match=r"must be .*, got nan"):
        server_config(build_parser().parse_args(["serve", option, "nan"]))


def test_one_connection_holds_at_most_max_concurrent_streams(make_server):
    server = make_server(max_concurrent_streams=2)
    with WeightClient(server.address) as client:
        client.publish({"w": torch.ones(4)}, model=MODEL)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            watches = [stub.Watch(pb.WatchRequest(model=MODEL, since=1)) for _ in range(2)]
            for call in watches:
                call.initial_metadata()
            # A third call on the same connection waits for a free stream...
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetLatest(pb.GetLatestRequest(model=MODEL), timeout=1.0)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # ...while other connections are served, and it proceeds once one is released.
            assert client.latest(MODEL).version == 1
            watches[0].cancel()
            assert stub.GetLatest(pb.GetLatestRequest(model=MODEL), timeout=10).version == 1
            watches[1].cancel()


def test_two_thousand_watchers_subscribing_at_once_all_get_in_and_hear_a_publish():
    """A burst beyond gRPC's default of 1000 pending calls (which cancelled the rest) must be
    served: after a restart every watcher resubscribes at the same moment."""
    from bench.idle_watchers import measure

    result = measure(2000)
    assert result.notified == 2000
    # Measured ~10-20 kB each (see docs/guides/limits.md); a generous bound that still catches a leak such as
    # a per-watcher copy of a version or a thread per watcher (8 MiB of stack each).
    assert result.bytes_per_watcher < 200_000, result


# ---------------------------------------------------------------------- descriptions
def many_tensors(count: int, name_chars: int = 8, fill: int = 0) -> bytes:
    """A safetensors file of `count` one-byte tensors with names of `name_chars` characters."""
    prefix, _ = build_header((f"{i:0{name_chars}d}", "U8", (1,), 1) for i in range(count))
    return prefix + bytes([fill % 256]) * count


@pytest.fixture
def default_stub(server) -> Iterator[pb_grpc.WeightServiceStub]:
    """A stub on a channel with gRPC's default limits (4 MiB messages), as any client has."""
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.WeightServiceStub(channel)


def assert_described(stub: pb_grpc.WeightServiceStub, model: str, latest: int) -> None:
    """GetLatest, Describe, Fetch, ListVersions and Watch all answer a default client."""
    assert stub.GetLatest(pb.GetLatestRequest(model=model), timeout=30).version == latest
    assert stub.Describe(pb.DescribeRequest(model=model), timeout=30).version == latest
    assert next(stub.Fetch(pb.FetchRequest(model=model), timeout=30)).header.version == latest
    listed = stub.ListVersions(pb.ListVersionsRequest(model=model), timeout=30).versions
    assert listed[-1].version == latest
    watch = stub.Watch(pb.WatchRequest(model=model), timeout=30)
    assert [next(watch).version.version for _ in listed] == [v.version for v in listed]
    watch.cancel()


@pytest.mark.parametrize(
    "case",
    ["7 MiB of metadata", "long tensor names", "40k tensors"],
)
def test_a_version_clients_could_not_receive_is_refused_before_it_commits(server, default_stub, case):
    with WeightServiceClient(server.address) as client:
        assert client.publish_bytes(MODEL, many_tensors(100)).version == 1
        if case == "7 MiB of metadata":
            error, fragments = DescriptionTooLarge, [f"limit of {MAX_DESCRIPTION_BYTES} bytes", "less metadata"]
            data, metadata = many_tensors(100, fill=1), {"notes": "x" * (7 * MiB)}
        elif case == "long tensor names":  # 20k tensors, within the count, but 1.7 MB to describe
            error, fragments = DescriptionTooLarge, [f"limit of {MAX_DESCRIPTION_BYTES} bytes", "fewer tensors"]
            data, metadata = many_tensors(20_000, name_chars=40), {}
        else:
            error, fragments = InvalidSafetensors, [f"over the limit of {PUBLISH_MAX_TENSORS} tensors"]
            data, metadata = many_tensors(40_000), {}
        with pytest.raises(error) as caught:
            client.publish_bytes(MODEL, data, metadata=metadata)
        for fragment in fragments:
            assert fragment in str(caught.value)
        assert_described(default_stub, MODEL, latest=1)
        assert client.publish_bytes(MODEL, many_tensors(100, fill=2)).version == 2
        assert_described(default_stub, MODEL, latest=2)


def test_list_versions_stays_within_a_client_message_with_pinned_versions(server, default_stub):
    """ListVersions carries every retained description: a publish that would make it larger
    than a default client receives is refused, and says how to make room."""
    nine_tenths = many_tensors(8_000, name_chars=60)  # about 0.9 MiB to describe
    with WeightServiceClient(server.address) as client:
        assert client.publish_bytes(MODEL, nine_tenths, pin=True).version == 1
        assert client.publish_bytes(MODEL, nine_tenths, pin=True).version == 2
        assert client.publish_bytes(MODEL, nine_tenths).version == 3
        assert client.publish_bytes(MODEL, nine_tenths).version == 4  # keep 3: four retained
        with pytest.raises(DescriptionTooLarge, match="ListVersions reply") as caught:
            client.publish_bytes(MODEL, nine_tenths)
        assert "unpin or delete versions, or lower --keep" in str(caught.value)
        assert_described(default_stub, MODEL, latest=4)
        client.pin(MODEL, 1, pinned=False)
        assert client.publish_bytes(MODEL, nine_tenths).version == 5  # v1 is evicted by it
        assert [v.version for v in client.list_versions(MODEL)] == [2, 3, 4, 5]
        assert_described(default_stub, MODEL, latest=5)
