"""Exact versions read straight from a same-host server's shared memory, by the header file the
server keeps beside each version's file: no round trip, the same verified bytes, and the
server still hears of every read. Real servers, real files, real gRPC."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace

import grpc
import pytest
import torch
from waiting import sigstop, wait_until

from tests.integration.test_errors import chunks, file_bytes, header_request, watch_publish_start
from tests.integration.test_metrics import scrape, value, wait_for_value
from weightclient import IntegrityError, WeightClient
from weightclient.core.background import LatestOnlyWorker
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightserver.process import ServerProcess
from weightserver.protocol.errors import DeadlineExceeded, NotFoundError, VersionNotFound
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=generator),
        "b": torch.randn(32, generator=generator),
        "steps": torch.tensor([seed], dtype=torch.int64),
    }


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def header_file(server, version: int, model: str = MODEL):
    return server.shared_memory.directory / model / f"{version:012d}.header"


def settled(server, version: int) -> None:
    """Wait until the server rewrote the version's header file with the sha256 it computes after
    the commit: a test's own change to the files must not be overwritten by it."""
    wait_until(lambda: pb.VersionInfo.FromString(header_file(server, version).read_bytes()).sha256 != "", 10)


def learn(client: WeightClient, version: int = 1) -> None:
    """One fetch the server answers: the client learns the model's folder from it."""
    result = client.fetch(MODEL, version=version, transport="shm")
    assert result.stats.transport == "shm" and not result.stats.direct


@pytest.mark.parametrize("placed", [False, True])
def test_a_version_never_fetched_before_is_read_directly_bit_exact(server, client, placed):
    client.publish(weights(1), model=MODEL)
    learn(client)
    client.publish(weights(2), model=MODEL)
    targets = {name: torch.zeros_like(t) for name, t in weights(2).items()}
    result = client.fetch(MODEL, version=2, transport="shm", place=(lambda info: targets) if placed else None)
    assert result.stats.direct and result.stats.transport == "shm" and result.version == 2
    assert result.placed is placed
    assert_same(result.tensors, weights(2))
    if placed:
        assert_same(targets, weights(2))
    # The header file says what the server says, and gets the sha256 once it is computed.
    assert replace(result.info, sha256="") == replace(client.describe(MODEL, 2), sha256="")

    def header_file_caught_up() -> bool:
        direct = client.fetch(MODEL, version=2, transport="shm")
        return direct.stats.direct and direct.info.sha256 != "" and direct.info == client.describe(MODEL, 2)

    wait_until(header_file_caught_up, 10)


def test_a_direct_read_needs_no_answer_from_the_server():
    """With the server process stopped (SIGSTOP) a fetch of the latest fails at its deadline,
    while an exact version still in shared memory is read as if the server were there."""
    with ServerProcess() as server, WeightClient(server.address, timeout=5) as client:
        client.publish(weights(1), model=MODEL)
        learn(client)
        client.publish(weights(2), model=MODEL)
        sigstop(server.process.pid)
        try:
            # Asking the stopped server would end in DeadlineExceeded after 1 s, as below.
            result = client.fetch(MODEL, version=2, transport="shm", timeout=1.0, retry=False)
            assert result.stats.direct
            assert_same(result.tensors, weights(2))
            with pytest.raises(DeadlineExceeded):
                client.fetch(MODEL, transport="shm", timeout=0.5, retry=False)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert client.flush(10)  # the report, held up by the stopped server, got through


def test_the_server_counts_direct_reads_for_the_client_that_made_them(make_server):
    server = make_server(metrics_port=0)
    with WeightClient(server.address, client_id="collector-7") as client:
        client.publish(weights(1), model=MODEL)
        learn(client)
        client.publish(weights(2), model=MODEL)
        served = value(scrape(server), "weightserver_fetch_bytes_total", model=MODEL, transport="shm")
        result = client.fetch(MODEL, version=2, transport="shm")
        assert result.stats.direct
        assert client.flush(10)
        labels = {"client_id": "collector-7", "model": MODEL}
        wait_for_value(server, "weightserver_client_last_fetched_version", 2.0, **labels)
        after = value(scrape(server), "weightserver_fetch_bytes_total", model=MODEL, transport="shm")
        assert after == served + result.info.byte_size


def test_pinning_rewrites_the_header_a_direct_read_returns(server, client):
    client.publish(weights(1), model=MODEL)
    learn(client)
    client.publish(weights(2), model=MODEL)
    client.pin(MODEL, 2)
    pinned = client.fetch(MODEL, version=2, transport="shm")
    assert pinned.stats.direct and pinned.info.pinned
    client.pin(MODEL, 2, pinned=False)
    unpinned = client.fetch(MODEL, version=2, transport="shm")
    assert unpinned.stats.direct and not unpinned.info.pinned


def test_deleted_and_evicted_versions_are_not_found_as_before(make_server):
    server = make_server(keep=2)
    with WeightClient(server.address) as client:
        client.publish(weights(1), model=MODEL)
        learn(client)
        client.publish(weights(2), model=MODEL)
        client.delete(MODEL, 2)
        assert not header_file(server, 2).exists()
        with pytest.raises(VersionNotFound):
            client.fetch(MODEL, version=2, transport="shm")
        client.publish(weights(3), model=MODEL)
        client.publish(weights(4), model=MODEL)  # keep=2 evicts v1
        assert not header_file(server, 1).exists()
        with pytest.raises(NotFoundError):  # VersionEvicted
            client.fetch(MODEL, version=1, transport="shm")
        assert client.fetch(MODEL, version=4, transport="shm").stats.direct


def test_a_publish_in_progress_has_no_header_and_cannot_be_read(server, client):
    client.publish(weights(1), model=MODEL)
    learn(client)
    started = watch_publish_start(server)
    data = file_bytes(weights(2))
    sent = threading.Event()
    release = threading.Event()

    def requests():
        yield header_request(MODEL, data)
        yield from chunks(data, 1024)
        sent.set()
        release.wait(10)

    with grpc.insecure_channel(server.address) as channel:
        future = pb_grpc.WeightServiceStub(channel).Publish.future(requests(), timeout=30)
        try:
            assert started.wait(10) and sent.wait(10)
            assert sorted(p.name for p in header_file(server, 1).parent.glob("*.header")) == [f"{1:012d}.header"]
            with pytest.raises(VersionNotFound):
                client.fetch(MODEL, version=2, transport="shm")
        finally:
            release.set()
            future.cancel()


def test_a_header_that_does_not_match_its_file_sends_the_fetch_to_the_server(server, client):
    """A header whose digests the file fails (damaged, or not the server's) costs the direct
    path, never the result: the server's own description decides, and the file passes it."""
    client.publish(weights(1), model=MODEL)
    learn(client)
    client.publish(weights(2), model=MODEL)
    settled(server, 2)
    path = header_file(server, 2)
    header = pb.VersionInfo.FromString(path.read_bytes())
    header.tensors[0].xxh3 = "0" * 32
    os.chmod(path, 0o644)
    path.write_bytes(header.SerializeToString())
    targets = {name: torch.zeros_like(t) for name, t in weights(2).items()}
    result = client.fetch(MODEL, version=2, place=lambda info: targets)
    assert not result.stats.direct and result.placed
    assert_same(targets, weights(2))


@pytest.mark.parametrize("damage", ["writable by others", "another version", "not a header", "missing file"])
def test_headers_not_to_be_trusted_are_ignored(server, client, damage):
    client.publish(weights(1), model=MODEL)
    learn(client)
    client.publish(weights(2), model=MODEL)
    settled(server, 2)
    path = header_file(server, 2)
    os.chmod(path, 0o644)
    if damage == "writable by others":
        os.chmod(path, 0o666)
    elif damage == "another version":
        path.write_bytes(header_file(server, 1).read_bytes())
    elif damage == "not a header":
        path.write_bytes(b"\xff" * 40)
    else:
        (path.parent / f"{2:012d}.safetensors").unlink()
    result = client.fetch(MODEL, version=2, transport="shm")
    assert not result.stats.direct
    assert_same(result.tensors, weights(2))


def test_deltas_casts_latest_and_other_models_ask_the_server(server, client):
    client.publish(weights(1), model=MODEL)
    client.publish(weights(1), model="critic")
    learn(client)
    client.publish(weights(2), model=MODEL)
    client.publish(weights(2), model="critic")
    assert not client.fetch(MODEL, transport="shm").stats.direct  # latest: only the server knows
    assert not client.fetch(MODEL, version=2, base=1, transport="shm").stats.direct
    assert not client.fetch(MODEL, version=2, dtype="BF16", transport="shm").stats.direct
    assert not client.fetch(MODEL, version=2, transport="bulk").stats.direct
    assert not client.fetch("critic", version=2, transport="shm").stats.direct  # its folder is not learned yet
    assert client.fetch("critic", version=2, transport="shm").stats.direct


def test_watch_weights_reads_each_new_version_directly(server, client):
    client.publish(weights(1), model=MODEL)
    seen = []
    for result in client.watch_weights(MODEL):
        seen.append((result.version, result.stats.direct))
        assert_same(result.tensors, weights(result.version))
        if result.version == 3:
            break
        client.publish(weights(result.version + 1), model=MODEL)
    assert seen == [(1, False), (2, True), (3, True)]


def test_a_pinned_updater_reads_its_version_directly(server, client):
    trainer = torch.nn.Linear(8, 4)
    client.publish(trainer, model=MODEL)
    client.publish(trainer, model=MODEL)
    with WeightClient(server.address) as own:
        learn(own)
        policy = torch.nn.Linear(8, 4)
        updater = GrpcLocalWeightUpdater(own, policy=policy, transport="shm", version=2)
        updater()
        assert updater.version == 2 and updater.last_fetch.direct
    assert_same(dict(policy.state_dict()), dict(trainer.state_dict()))


def test_a_file_damaged_under_its_header_is_refused_everywhere(server, client):
    """A version's file the server wrote itself (a publish over the stream) is its own memory:
    damage to it (by root) fails the direct read's digests, and the server's stream refuses it too
    (IntegrityError), as without direct reads. (A same-host publisher's file is sealed: see
    test_byte_ownership.)"""
    client.publish(weights(1), model=MODEL, transport="stream")
    learn(client)
    client.publish(weights(2), model=MODEL, transport="stream")
    settled(server, 2)
    path = header_file(server, 2).with_suffix(".safetensors")
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1)
        f.write(b"\x7f")
    with pytest.raises(IntegrityError):
        client.fetch(MODEL, version=2, transport="shm")


# ---------------------------------------------------------------------- reports (LatestOnlyWorker)
class Sender:
    """Stands in for the Negotiate call: records what it is given, and can be held."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, request: pb.FetchRequest) -> None:
        self.entered.release()
        assert self.hold.wait(10)
        self.sent.append(request.version)
        if request.version == 13:
            raise grpc.RpcError("the server is gone")


def request(version: int) -> pb.FetchRequest:
    return pb.FetchRequest(model=MODEL, version=version)


def test_reports_made_while_one_is_in_flight_collapse_to_the_latest():
    sender = Sender()
    reports = LatestOnlyWorker(sender, "reports")
    sender.hold.clear()
    reports.put(request(1))
    assert sender.entered.acquire(timeout=10)  # v1 is being sent
    for version in (2, 3, 4):
        reports.put(request(version))
    assert not reports.flush(0.05)
    sender.hold.set()
    assert reports.flush(10)
    assert sender.sent == [1, 4]


def test_a_failed_report_is_dropped_and_the_next_one_still_goes():
    sender = Sender()
    reports = LatestOnlyWorker(sender, "reports")
    reports.put(request(13))
    assert reports.flush(10)
    reports.put(request(14))
    assert reports.flush(10)
    assert sender.sent == [13, 14]


def test_closed_reports_send_nothing_more():
    sender = Sender()
    reports = LatestOnlyWorker(sender, "reports")
    reports.put(request(1))
    assert reports.flush(10)
    reports.close()
    reports.put(request(2))
    assert reports.flush(10) and sender.sent == [1]


def test_direct_reads_work_under_a_group_writable_umask(make_server):
    """Folders the server makes are 0755 whatever the umask (002 is common), since a client
    trusts no header in a folder that others may write."""
    previous = os.umask(0o002)
    try:
        server = make_server()
        with WeightClient(server.address) as client:
            client.publish(weights(1), model=MODEL)
            learn(client)
            client.publish(weights(2), model=MODEL)
            assert client.fetch(MODEL, version=2, transport="shm").stats.direct
        assert header_file(server, 1).parent.stat().st_mode & 0o777 == 0o755
    finally:
        os.umask(previous)
