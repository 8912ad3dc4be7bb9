"""Issue 14 item 9: many stream fetchers must not starve a publish.

Stream fetches send their chunks a bounded number at a time (--max-stream-fetches), the rest
waiting their turn; a fetch whose reader stops reading gives its turn back; a publish's commit
runs on threads of its own. Raw generated stubs play the fetchers, so that a test decides
exactly when each one reads. No speed is asserted (only that fetches wait behind a commit
that hangs, and no longer than they should): speed under load is measured in the bench row
`publish_under_fetch_load`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time

import grpc
import pytest

from weightclient.core.service_client import WeightServiceClient
from weightserver import ServerConfig
from weightserver.cli import build_parser
from weightserver.storage.payloads import PayloadCache
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
WAIT = 30.0


def safetensors_file(nbytes: int, dtype: str = "U8") -> bytes:
    """A one-tensor safetensors file of `nbytes` random data bytes."""
    numel = nbytes // {"U8": 1, "F32": 4}[dtype]
    header = json.dumps({"w": {"dtype": dtype, "shape": [numel], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + os.urandom(nbytes)


def channels(address: str, count: int) -> list[grpc.Channel]:
    """`count` channels on connections of their own (gRPC otherwise shares one)."""
    return [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)]


def received(call) -> bytes:
    """The chunks of a Fetch call still to come, joined."""
    return b"".join(message.chunk for message in call)


def test_a_publish_lands_while_every_fetch_turn_is_taken_and_the_queued_fetches_then_complete(make_server):
    server = make_server(max_stream_fetches=2, shm_dir=None, bulk_port=None)
    first, second = safetensors_file(8 << 20), safetensors_file(8 << 20)
    open_channels = channels(server.address, 4)
    try:
        with WeightServiceClient(server.address) as client:
            assert client.publish_bytes(MODEL, first).version == 1
            # 16 fetches in flight: each has its header (sent before it waits for a turn), none
            # is read further, so two hold the turns (their writes stalled) and the rest queue.
            calls = [
                pb_grpc.WeightServiceStub(open_channels[i % 4]).Fetch(pb.FetchRequest(model=MODEL), timeout=WAIT * 2)
                for i in range(16)
            ]
            for call in calls:
                assert next(call).header.version == 1
            assert client.publish_bytes(MODEL, second, timeout=WAIT).version == 2
            assert client.latest(MODEL).version == 2
            digests = {hashlib.sha256(received(call)).hexdigest() for call in calls}
            assert digests == {hashlib.sha256(first).hexdigest()}  # every one, whole, of the version it began
            assert hashlib.sha256(client.fetch_bytes(MODEL, transport="stream").data).digest() == (
                hashlib.sha256(second).digest()
            )
    finally:
        for channel in open_channels:
            channel.close()


def test_a_fetch_whose_reader_stalls_gives_its_turn_to_the_fetches_behind_it(make_server):
    server = make_server(max_stream_fetches=1, shm_dir=None, bulk_port=None)
    data = safetensors_file(32 << 20)  # more than the connection's flow-control windows hold
    stalled_channel, other_channel = channels(server.address, 2)
    try:
        with WeightServiceClient(server.address) as client:
            client.publish_bytes(MODEL, data)
        stalled = pb_grpc.WeightServiceStub(stalled_channel).Fetch(pb.FetchRequest(model=MODEL), timeout=WAIT * 2)
        assert next(stalled).header.version == 1
        first_chunk = next(stalled).chunk  # it holds the only turn, then stops reading
        behind = pb_grpc.WeightServiceStub(other_channel).Fetch(pb.FetchRequest(model=MODEL), timeout=WAIT)
        assert next(behind).header.version == 1
        assert received(behind) == data  # would wait for its deadline if the stalled one kept the turn
        assert first_chunk + received(stalled) == data
    finally:
        stalled_channel.close()
        other_channel.close()


def test_a_publish_commits_while_asyncio_default_threads_are_all_busy(make_server, monkeypatch):
    """Casts and deltas are built on asyncio's default threads; a backlog of them (here: every
    one held) must not queue a publish's commit."""
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default pool
    entered, release = threading.Semaphore(0), threading.Event()
    original = PayloadCache.get

    def held_get(self, target, base=None, dtype="", *args, **kwargs):
        if dtype:
            entered.release()
            release.wait(WAIT)
        return original(self, target, base, dtype, *args, **kwargs)

    monkeypatch.setattr(PayloadCache, "get", held_get)
    server = make_server(shm_dir=None, bulk_port=None)
    first = safetensors_file(1 << 20, "F32")
    (channel,) = channels(server.address, 1)
    try:
        with WeightServiceClient(server.address) as client:
            client.publish_bytes(MODEL, first)
            stub = pb_grpc.WeightServiceStub(channel)
            casts = [stub.Fetch(pb.FetchRequest(model=MODEL, dtype="BF16"), timeout=WAIT * 2) for _ in range(workers)]
            for _ in range(workers):
                assert entered.acquire(timeout=WAIT), "the casts did not all start"
            try:
                assert client.publish_bytes(MODEL, safetensors_file(1 << 20, "F32"), timeout=WAIT).version == 2
            finally:
                release.set()
            for call in casts:
                messages = list(call)
                assert messages[0].header.version == 1 and messages[1].payload.dtype == "BF16"
    finally:
        channel.close()


def test_max_stream_fetches_is_a_serve_flag_with_a_default_from_the_cpu_count():
    assert build_parser().parse_args(["serve", "--max-stream-fetches", "3"]).max_stream_fetches == 3
    assert ServerConfig().max_stream_fetches == max(2, os.cpu_count() or 1)
    with pytest.raises(ValueError, match="max_stream_fetches"):
        ServerConfig(max_stream_fetches=0)


def test_stream_fetches_hold_their_chunks_while_a_publish_commits_but_never_stop(make_server, monkeypatch):
    """Commits first: while a publish verifies and commits, each stream fetch chunk waits for it,
    at most COMMIT_FIRST_SECONDS, so a commit that hangs slows fetches down without stopping them."""
    import weightserver.publish.priority as commits_first
    from weightserver.storage.store import VersionStore

    monkeypatch.setattr(commits_first, "COMMIT_FIRST_SECONDS", 0.2)
    server = make_server()
    data = safetensors_file(6 * 64 * 1024)  # 7 chunks of 64 KiB
    held, entered = threading.Event(), threading.Event()
    real = VersionStore.commit

    def held_commit(self, *args, **kwargs):
        if threading.current_thread().name.startswith("weightserver-publish"):
            entered.set()
            assert held.wait(WAIT)
        return real(self, *args, **kwargs)

    with WeightServiceClient(server.address, chunk_bytes=64 * 1024) as client:
        client.publish_bytes(MODEL, data, transport="stream")  # a version to fetch
        monkeypatch.setattr(VersionStore, "commit", held_commit)
        publisher = threading.Thread(target=lambda: client.publish_bytes(MODEL, data, transport="stream"))
        publisher.start()
        assert entered.wait(WAIT)  # a commit is under way, and hangs
        started = time.monotonic()
        fetched = client.fetch_bytes(MODEL, version=1, transport="stream", timeout=WAIT)
        during = time.monotonic() - started
        held.set()
        publisher.join(WAIT)
        started = time.monotonic()
        again = client.fetch_bytes(MODEL, version=1, transport="stream", timeout=WAIT)
        after = time.monotonic() - started
    assert bytes(fetched.data) == bytes(again.data) == data  # it finished, whole
    assert during >= 6 * 0.2  # each chunk after the first waited its turn behind the commit
    assert after < during
