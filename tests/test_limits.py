"""Server limits: how long a publish may take, how many calls one connection may hold, and
what a thousand idle watchers cost."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from weightclient import WeightClient
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"


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
    # Measured ~10-20 kB each (see README); a generous bound that still catches a leak such as
    # a per-watcher copy of a version or a thread per watcher (8 MiB of stack each).
    assert result.bytes_per_watcher < 200_000, result
