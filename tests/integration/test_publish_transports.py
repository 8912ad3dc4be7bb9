"""Publishing over bulk TCP and shared memory (issue 15): Negotiate with DIRECTION_PUBLISH sets
an upload up, the bytes move outside the Publish stream, and a Publish stream names the upload.
Bit-exact over every transport, the fallbacks, and every way a publish can stop half-way: none
of them ever makes a version visible."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch
import xxhash
from waiting import wait_equal, wait_until

import weightserver.publish.staged_uploads as staged_uploads
from tests.integration.test_fast_paths import assert_bit_exact, mixed_model
from weightclient import WeightClient
from weightclient import tensors as tensor_codec
from weightclient.transports import BulkTransport, SharedMemoryTransport, TransportFailed
from weightclient.transports.shared_memory import UPLOAD_MEMORY
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
SHM, BULK = pb.TRANSPORT_SHARED_MEMORY, pb.TRANSPORT_BULK


def file_of(weights: dict[str, torch.Tensor]) -> bytes:
    return b"".join(bytes(part) for part in tensor_codec.encode(weights))


def negotiate_publish(address: str, accept: list[int], header: pb.PublishHeader) -> pb.NegotiateResponse:
    request = pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH, accept=accept, publish=header)
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WeightServiceStub(channel).Negotiate(request, timeout=30)


def publish_uploaded(address: str, header: pb.PublishHeader, upload: str, *, commit: bool = True) -> pb.PublishResponse:
    """A Publish stream, with the generated stub, that names `upload` instead of sending chunks."""
    messages = [pb.PublishRequest(header=header), pb.PublishRequest(uploaded=pb.PublishUploaded(upload=upload))]
    if commit:
        messages.append(pb.PublishRequest(commit=pb.PublishCommit()))
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WeightServiceStub(channel).Publish(iter(messages), timeout=30)


def send_upload(port: int, ticket: bytes, data: bytes, *, cut_after: int | None = None) -> bytes:
    """Send a ticket and `data` (or only its first `cut_after` bytes, then close) to the bulk
    port; what the server answered (its ACK, or b"" when it closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(ticket + (data if cut_after is None else data[:cut_after]))
            if cut_after is not None:
                return b""
            conn.settimeout(10)
            return conn.recv(16)
        except ConnectionResetError:  # the server stopped reading and closed
            return b""


def assert_nothing_visible(client: WeightClient, before: int) -> None:
    """The model's latest version is still `before`, and no upload file became a version."""
    assert client.latest(MODEL).version == before
    assert [v.version for v in client.list_versions(MODEL)][-1] == before


def identity_of(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def released(path: str, identity: tuple[int, int]) -> bool:
    """An upload's /proc/<pid>/fd/<n> no longer names that memfd (the number may be reused)."""
    try:
        return identity_of(path) != identity
    except FileNotFoundError:
        return True


def staged_count(server) -> int:
    from tests.integration.test_fast_paths import servicer_of

    return len(servicer_of(server).staged)


# ---------------------------------------------------------------------- every transport
@pytest.mark.parametrize("transport", ["stream", "bulk", "shm", "auto"])
def test_publish_over_every_transport_is_bit_exact(server, client, transport):
    weights = mixed_model()
    sent: list[int] = []
    version = client.publish_bytes(
        MODEL, tensor_codec.encode(weights), transport=transport, progress=lambda done, total: sent.append(done)
    ).version
    assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)
    used = {"auto": "shm"}.get(transport, transport)
    if used != "stream":
        assert client.transports.usable(used) is True  # it carried the bytes
    assert sent and sent[-1] == len(file_of(weights))
    info = client.describe(MODEL, version)
    assert info.xxh3 == xxhash.xxh3_128_hexdigest(file_of(weights))
    # Nothing of this publish stays staged; a fast one set its successor up (a spare).
    wait_equal(lambda: staged_count(server), (0 if used == "stream" else 1), what="uploads staged")


def test_a_group_publish_over_bulk_commits_once(server, client):
    policy, critic = mixed_model(1), mixed_model(2)
    version = client.publish_group({"policy": policy, "critic": critic}, transport="bulk")
    for model, weights in (("policy", policy), ("critic", critic)):
        assert_bit_exact(client.fetch(model, version=version, transport="shm").state_dict(), weights)
        assert list(client.describe(model).group) == ["policy", "critic"]


def test_the_publishers_sealed_memfd_becomes_the_versions_file(server, client):
    """The version's file is a link to the memfd the publisher wrote, sealed: no upload file is
    left in the folder, nobody can write it, and it holds the version's bytes."""
    weights = mixed_model()
    version = client.publish(weights, model=MODEL, transport="shm")
    wait_equal(lambda: staged_count(server), 1, what="uploads staged")  # the next upload, set up ahead
    folder = server.shared_memory.directory / MODEL
    files = sorted(p.name for p in folder.iterdir() if not p.name.startswith("upload-"))  # beside the spare's link
    assert files == [f"{version:012d}.header", f"{version:012d}.safetensors"]
    own = folder / f"{version:012d}.safetensors"
    assert os.readlink(own).startswith(f"/proc/{os.getpid()}/fd/")  # the server runs in this process
    assert own.read_bytes() == file_of(weights)
    fd = os.open(own, os.O_RDWR)  # as the server's user, or root: the file opens, its bytes do not change
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    assert own.read_bytes() == file_of(weights)


def test_bulk_and_shm_publishes_of_a_large_model_are_bit_exact(server, client):
    weights = {"big": torch.randn(3 << 20), "small": torch.arange(7, dtype=torch.int64)}  # 12 MiB: several blocks
    for transport in ("bulk", "shm"):
        weights["big"].add_(1)
        version = client.publish(weights, model=MODEL, transport=transport)
        assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)


@pytest.mark.parametrize("cores", [2, 8])
def test_a_large_shm_upload_written_by_several_threads_declares_its_bytes_digests(server, client, monkeypatch, cores):
    """From 64 MiB two threads copy a shared-memory upload's blocks into the mapped upload (four where
    there are 6+ cores), and runs of copied blocks are hashed in file order by whichever thread finds
    the next one copied; with 5+ cores the file's digest of a run is taken on a thread of its own while
    that thread hashes the tensors. A model of odd-sized tensors, the helper threads' copies held back
    so that blocks are done out of order: the xxh3s declared at `uploaded` (file and every tensor) are
    those of the bytes, and the version comes back bit-exact."""
    import numpy

    from weightclient.transports.shared_memory import UNMAP_FROM
    from weightserver.protocol import cpus as usable
    from weightserver.protocol.digests import IncomingDigests
    from weightserver.protocol.safetensors_format import parse_header

    copied_by: set[str] = set()
    copyto, upload, advance = numpy.copyto, SharedMemoryTransport.upload, IncomingDigests.advance
    declared, spans = [], []

    def hashed(self, end, **options):
        spans.append(options.get("spans") is not None)
        advance(self, end, **options)

    def held(target, source):
        copied_by.add(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.003)
        copyto(target, source)

    def recorded(self, *args, **kwargs):
        declared.append(upload(self, *args, **kwargs))
        return declared[-1]

    gen = torch.Generator().manual_seed(3)
    weights = {**mixed_model(4), **{f"odd{i}": torch.randn(1_000_003 + 7919 * i, generator=gen) for i in range(17)}}
    data = file_of(weights)
    assert len(data) >= UNMAP_FROM
    monkeypatch.setattr(numpy, "copyto", held)
    monkeypatch.setattr(SharedMemoryTransport, "upload", recorded)
    monkeypatch.setattr(IncomingDigests, "advance", hashed)
    monkeypatch.setattr(usable, "usable_cpus", lambda: cores)
    for step in range(2):  # mapped when it comes, then the upload set up ahead
        weights["odd3"].add_(step)
        data = file_of(weights)
        version = client.publish(weights, model=MODEL, transport="shm")
        assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)
        header = parse_header(data, len(data))
        view = memoryview(data)[header.data_start :]
        assert declared[-1].xxh3 == xxhash.xxh3_128_hexdigest(data)
        tensors = {t.name: xxhash.xxh3_128_hexdigest(view[t.begin : t.end]) for t in header.tensors}
        assert declared[-1].tensor_xxh3 == tensors
    helpers = {name for name in copied_by if name.startswith("weightclient-copy")}
    assert "MainThread" in copied_by and len(helpers) == (1 if cores < 4 else 3), copied_by
    assert any(spans) == (cores >= 4), spans


def test_a_shm_upload_past_its_deadline_stops_both_writing_threads(server, client, monkeypatch):
    """The deadline is checked before each block is copied and before each is hashed: whichever of the
    two writing threads finds it spent, the publish fails with DeadlineExceeded soon after, the other
    thread stops, and nothing becomes visible; the next publish commits."""
    from weightclient import DeadlineExceeded
    from weightserver.protocol.digests import IncomingDigests

    advance = IncomingDigests.advance

    def held(self, end, **options):  # 50 ms per MiB hashed, however many blocks one call takes
        time.sleep(0.05 * max(1, (end - self.hashed) >> 20))
        advance(self, end, **options)

    monkeypatch.setattr(IncomingDigests, "advance", held)
    weights = {"w": torch.randn(17 << 20)}  # 68 MiB: two threads, about 4 s of held hashes
    before = client.publish(weights, model=MODEL, transport="shm")  # (sets the next upload up)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="writing the upload took longer"):
        client.publish(weights, model=MODEL, transport="shm", timeout=1.5)
    assert time.monotonic() - started < 2.5
    wait_until(lambda: not any(t.name.startswith("weightclient-copy") for t in threading.enumerate()), what="no writer")
    assert_nothing_visible(client, before)
    monkeypatch.setattr(IncomingDigests, "advance", advance)
    assert client.publish(weights, model=MODEL, transport="shm") == before + 1


# ---------------------------------------------------------------------- the contract, by hand
def test_a_raw_bulk_upload_is_acknowledged_and_committed_by_a_publish_stream(server, client):
    """What a client in another language does: Negotiate, send ticket + bytes, read the ACK,
    then Publish naming the upload."""
    data = file_of(mixed_model())
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(server.address, [BULK], header)
    assert answer.transport == BULK and answer.upload and answer.payload.byte_size == len(data)
    assert not client.list_models()  # nothing visible while the bytes are staged
    assert send_upload(answer.payload.bulk.port, answer.payload.bulk.ticket, data) == b"\x01"
    header.sha256 = hashlib.sha256(data).hexdigest()
    reply = publish_uploaded(server.address, header, answer.upload)
    assert reply.version.version == 1 and reply.version.byte_size == len(data)
    assert client.fetch_bytes(MODEL, transport="stream").data == data
    with pytest.raises(grpc.RpcError) as caught:  # an upload is used once
        publish_uploaded(server.address, header, answer.upload)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "unknown, used already or expired" in str(caught.value)


def test_a_raw_shm_upload_is_written_in_place_and_committed(server, client):
    data = file_of(mixed_model())
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(server.address, [SHM, BULK], header)
    assert answer.transport == SHM
    path = answer.payload.shared_memory.path
    assert os.path.getsize(path) == len(data)
    identity = identity_of(path)
    with open(path, "r+b") as f:
        f.write(data)
    header.sha256 = hashlib.sha256(data).hexdigest()
    assert publish_uploaded(server.address, header, answer.upload).version.version == 1
    assert not os.path.lexists(path)  # the upload's link went: the memfd is the version's file now
    assert identity_of(server.shared_memory.directory / MODEL / f"{1:012d}.safetensors") == identity
    assert client.fetch_bytes(MODEL, transport="shm").data.tobytes() == data


@pytest.mark.parametrize(
    ("change", "code", "text"),
    [
        ({"model": "critic"}, grpc.StatusCode.INVALID_ARGUMENT, "was set up for 'policy'"),
        ({"total_bytes": 1}, grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
        ({"upload": "nope"}, grpc.StatusCode.NOT_FOUND, "'nope' is unknown"),
    ],
)
def test_a_publish_must_name_its_own_upload(server, client, change, code, text):
    data = file_of(mixed_model())
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(server.address, [BULK], header)
    assert send_upload(answer.payload.bulk.port, answer.payload.bulk.ticket, data) == b"\x01"
    upload = change.pop("upload", answer.upload)
    fields = {"model": MODEL, "total_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **change}
    header = pb.PublishHeader(**fields)
    with pytest.raises(grpc.RpcError) as caught:
        publish_uploaded(server.address, header, upload)
    assert caught.value.code() == code and text in caught.value.details()
    assert not client.list_models()


def test_chunks_and_an_upload_for_one_model_are_refused(server):
    data = file_of(mixed_model())
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    answer = negotiate_publish(server.address, [SHM], header)
    identity = identity_of(answer.payload.shared_memory.path)
    messages = [
        pb.PublishRequest(header=header),
        pb.PublishRequest(uploaded=pb.PublishUploaded(upload=answer.upload)),
        pb.PublishRequest(chunk=data[:10]),
        pb.PublishRequest(commit=pb.PublishCommit()),
    ]
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.WeightServiceStub(channel).Publish(iter(messages), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one or the other" in caught.value.details()
    assert released(answer.payload.shared_memory.path, identity)  # the stream's upload went with it


def test_negotiate_checks_the_header_first(server, client):
    client.publish(mixed_model(), model=MODEL, version=5, transport="stream")  # sets no spare up
    cases = [
        (pb.PublishHeader(model="../x", total_bytes=10), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.PublishHeader(model=MODEL, total_bytes=10, version=3), grpc.StatusCode.FAILED_PRECONDITION),
        (pb.PublishHeader(model=MODEL, total_bytes=64 << 40), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]
    for header, code in cases:
        with pytest.raises(grpc.RpcError) as caught:
            negotiate_publish(server.address, [SHM, BULK], header)
        assert caught.value.code() == code, header
    assert staged_count(server) == 0
    # An empty file, or a caller that accepts no fast transport, is answered with the stream.
    for accept, size in (([], 10), ([SHM, BULK], 0)):
        answer = negotiate_publish(server.address, accept, pb.PublishHeader(model=MODEL, total_bytes=size))
        assert answer.transport == pb.TRANSPORT_STREAM and not answer.upload and not answer.HasField("payload")


def test_staged_uploads_are_bounded(server, monkeypatch):
    from tests.integration.test_fast_paths import servicer_of

    monkeypatch.setattr(servicer_of(server).staged, "_max", 3)
    header = pb.PublishHeader(model=MODEL, total_bytes=64)
    for _ in range(3):
        assert negotiate_publish(server.address, [BULK], header).transport == BULK
    with pytest.raises(grpc.RpcError) as caught:
        negotiate_publish(server.address, [BULK], header)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "set up and not yet committed" in str(
        caught.value
    )


# ---------------------------------------------------------------------- half-way
def test_a_bulk_upload_cut_short_is_never_visible(server, client):
    client.publish(mixed_model(1), model=MODEL)
    data = file_of(mixed_model(2))
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data))
    answer = negotiate_publish(server.address, [BULK], header)
    send_upload(answer.payload.bulk.port, answer.payload.bulk.ticket, data, cut_after=len(data) // 2)
    header.sha256 = hashlib.sha256(data).hexdigest()
    with pytest.raises(grpc.RpcError) as caught:
        publish_uploaded(server.address, header, answer.upload)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "did not arrive whole" in caught.value.details()
    assert_nothing_visible(client, 1)


def test_a_shm_upload_written_half_way_and_never_committed_is_never_visible(server, client, monkeypatch):
    client.publish(mixed_model(1), model=MODEL, transport="stream")
    data = file_of(mixed_model(2))
    monkeypatch.setattr(staged_uploads, "UPLOAD_TTL_SECONDS", 1.0)
    answer = negotiate_publish(server.address, [SHM], pb.PublishHeader(model=MODEL, total_bytes=len(data)))
    path = answer.payload.shared_memory.path
    identity = identity_of(path)
    with open(path, "r+b") as f:
        f.write(data[: len(data) // 2])  # the publisher dies here
    assert_nothing_visible(client, 1)
    # The sweeper drops it within about a second.
    wait_until(lambda: released(path, identity), what="the upload let go")
    assert staged_count(server) == 0
    assert_nothing_visible(client, 1)


def test_an_uploads_name_is_never_reused_though_its_descriptor_number_is(server, client, monkeypatch):
    """A client keeps a spare upload's mapping by its name: were that /proc/<pid>/fd/<n>, an
    upload let go and the next one set up would share it, and the next publish would write into
    the old memfd (a full bench run committed zeros that way). Each upload is a link of its own."""
    monkeypatch.setattr(staged_uploads, "UPLOAD_TTL_SECONDS", 0.5)
    header = pb.PublishHeader(model=MODEL, total_bytes=1 << 20)
    names, targets = set(), []
    for _ in range(3):
        path = negotiate_publish(server.address, [SHM], header).payload.shared_memory.path
        names.add(path)
        targets.append(os.readlink(path))
        identity = identity_of(path)
        wait_until(lambda p=path, i=identity: released(p, i), what="the upload let go")
    assert len(names) == 3
    assert all(UPLOAD_MEMORY.fullmatch(target) for target in targets)


def test_a_publish_stream_that_ends_without_commit_drops_its_upload(server, client):
    data = file_of(mixed_model())
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    answer = negotiate_publish(server.address, [SHM], header)
    identity = identity_of(answer.payload.shared_memory.path)
    with open(answer.payload.shared_memory.path, "r+b") as f:
        f.write(data)
    with pytest.raises(grpc.RpcError) as caught:
        publish_uploaded(server.address, header, answer.upload, commit=False)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "without a commit" in caught.value.details()
    assert released(answer.payload.shared_memory.path, identity)
    assert not client.list_models()


def test_a_corrupted_upload_is_refused(server, client):
    data = bytearray(file_of(mixed_model()))
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    answer = negotiate_publish(server.address, [SHM], header)
    data[-1] ^= 0xFF  # a byte flipped after the digest was taken
    with open(answer.payload.shared_memory.path, "r+b") as f:
        f.write(data)
    with pytest.raises(grpc.RpcError) as caught:
        publish_uploaded(server.address, header, answer.upload)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert not client.list_models()


def test_a_malformed_file_stops_a_bulk_upload_early(server, client):
    data = b"\xff" * 8 + b"x" * (4 << 20)  # a header length far past the end
    answer = negotiate_publish(server.address, [BULK], pb.PublishHeader(model=MODEL, total_bytes=len(data)))
    assert send_upload(answer.payload.bulk.port, answer.payload.bulk.ticket, data) == b""  # closed, no ACK
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    with pytest.raises(grpc.RpcError) as caught:
        publish_uploaded(server.address, header, answer.upload)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in caught.value.details()
    assert not client.list_models()


def test_a_server_stopped_mid_upload_fails_the_publish_with_a_clear_status(make_server):
    srv = make_server(shm_dir=None)
    weights = {"w": torch.randn(64 << 20)}  # 256 MiB: the stop lands mid-transfer
    errors: list[BaseException] = []
    with WeightClient(srv.address) as c:

        def publish() -> None:
            try:
                c.publish(weights, model=MODEL, transport="bulk", timeout=20)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=publish)
        thread.start()
        wait_until(lambda: srv.bulk.connections, step=0.001, what="the bulk upload connected")
        srv.stop(grace=0)
        thread.join(30)
    assert not thread.is_alive()
    assert errors and type(errors[0]).__name__ in ("ServerUnavailable", "Cancelled", "DeadlineExceeded"), errors


# ---------------------------------------------------------------------- fallbacks
def test_publish_falls_back_when_the_server_offers_no_fast_transport(make_server):
    for settings, expected in (({"shm_dir": None}, "bulk"), ({"shm_dir": None, "bulk_port": None}, None)):
        srv = make_server(**settings)
        with WeightClient(srv.address) as c:
            weights = mixed_model()
            version = c.publish(weights, model=MODEL, transport="auto")
            assert_bit_exact(c.fetch(MODEL, version=version).state_dict(), weights)
            assert c.transports.usable("shm") is None
            assert c.transports.usable("bulk") is (True if expected == "bulk" else None)


def test_a_refused_bulk_port_falls_back_to_the_stream(make_server):
    srv = make_server(shm_dir=None)
    srv.bulk.close()  # the port stops answering
    with WeightClient(srv.address) as c:
        weights = mixed_model()
        version = c.publish(weights, model=MODEL, transport="bulk", timeout=30)
        assert_bit_exact(c.fetch(MODEL, version=version, transport="stream").state_dict(), weights)
        assert c.transports.usable("bulk") is False


def test_a_client_that_cannot_see_the_servers_shared_memory_publishes_over_bulk(server, tmp_path):
    """A publisher in mount and PID namespaces of its own (as in another container): the server's
    upload is not there, so it falls back to bulk TCP, and the version is bit-exact."""
    if os.geteuid() != 0:
        pytest.skip("needs root for unshare --mount")
    script = textwrap.dedent(
        f"""
        import torch
        from weightclient import WeightClient
        weights = {{"w": torch.arange(1 << 16, dtype=torch.float32)}}
        with WeightClient({server.address!r}) as c:
            version = c.publish(weights, model={MODEL!r}, transport="auto")
            print(version, c.transports.usable("shm"), c.transports.usable("bulk"))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # Its own /dev/shm and its own processes (/proc): the server's memfds cannot be opened by their path.
    mounts = 'mount -t tmpfs tmpfs /dev/shm && exec "$0" -c "$1"'
    command = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c", mounts]
    done = subprocess.run([*command, sys.executable, script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False", "True"]
    with WeightClient(server.address) as c:
        fetched = c.fetch(MODEL, version=1, transport="stream").state_dict()["w"]
    assert torch.equal(fetched, torch.arange(1 << 16, dtype=torch.float32))
    # The shm upload it could not write waits to expire (beside it, perhaps, the bulk upload the
    # publisher set up ahead before it exited).
    from tests.integration.test_fast_paths import servicer_of

    assert [t for t in servicer_of(server).staged.transports() if t == "shm"] == ["shm"]


def test_a_client_that_cannot_see_the_servers_shared_memory_stops_asking_for_it(server):
    """As in docker/compose.yaml, where each container has a /dev/shm of its own: the first publish or fetch
    finds the server's shared-memory folder missing, says so once at INFO, and shm stays off for this
    server. Before, it failed again after every rest (60 s), each time with a WARNING and a wasted try."""
    if os.geteuid() != 0:
        pytest.skip("needs root for unshare --mount")
    script = textwrap.dedent(
        f"""
        import logging, sys, time
        import torch
        from weightclient import WeightClient
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
        with WeightClient({server.address!r}) as c:
            c.transports.rest_seconds = 0.01  # a rest that ends before each next call
            for i in range(3):
                c.publish({{"w": torch.full((1 << 16,), float(i))}}, model={MODEL!r}, transport="auto")
                time.sleep(0.05)
                fetched = c.fetch({MODEL!r}, transport="auto")
                assert fetched.state_dict()["w"][0] == i and fetched.stats.transport == "bulk", fetched.stats
                time.sleep(0.05)
            print(c.transports.usable("shm"), c.transports.usable("bulk"))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    mounts = 'mount -t tmpfs tmpfs /dev/shm && exec "$0" -c "$1"'
    command = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c", mounts]
    done = subprocess.run([*command, sys.executable, script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    said = [line for line in done.stderr.splitlines() if "shm transport" in line]
    assert len(said) == 1, done.stderr
    assert said[0].startswith("INFO shm transport is off for this server: its shared memory (/dev/shm/"), said
    assert "is not visible from this process" in said[0]


def test_the_transports_refuse_what_is_not_an_upload_file(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"keep me")
    link = tmp_path / "upload-00.tmp"
    link.symlink_to(victim)
    for path in (victim, link):
        payload = pb.Payload(byte_size=7, shared_memory=pb.SharedMemoryFile(path=str(path)))
        with pytest.raises(TransportFailed):
            SharedMemoryTransport().upload(payload, [memoryview(b"weights")], deadline=None, progress=None)
    assert victim.read_bytes() == b"keep me"
    with pytest.raises(TransportFailed):  # the byte count must match what the server expects
        BulkTransport("127.0.0.1").upload(
            pb.Payload(byte_size=3, bulk=pb.BulkTicket(port=1, ticket=b"x" * 16)),
            [memoryview(b"weights")],
            deadline=None,
            progress=None,
        )


def test_errors_from_negotiate_reach_the_caller(server, client):
    client.publish(mixed_model(), model=MODEL, version=5, transport="stream")  # sets no spare up
    with pytest.raises(Exception) as caught:
        client.publish(mixed_model(), model=MODEL, version=2, transport="bulk")
    assert type(caught.value).__name__ == "VersionConflict"
    assert staged_count(server) == 0


# ---------------------------------------------------------------------- spare uploads
def version_file(server, version: int) -> str:
    return str(server.shared_memory.directory / MODEL / f"{version:012d}.safetensors")


def memfds() -> set[tuple[int, int]]:
    """The identities of the memfds of MODEL open in this process (where the server runs)."""
    found = set()
    for number in os.listdir(f"/proc/{os.getpid()}/fd"):
        path = f"/proc/{os.getpid()}/fd/{number}"
        with contextlib.suppress(OSError):
            if os.readlink(path).startswith(f"/memfd:weightserver-{MODEL} "):
                found.add(identity_of(path))
    return found


def spare(server, before: set[tuple[int, int]]) -> tuple[int, int]:
    """The identity of the one upload staged (the client's spare): of the memfds opened since
    `before` (earlier tests' may linger until collected), the one that is no version's file."""
    wait_equal(lambda: staged_count(server), 1, what="uploads staged")
    kept = {identity_of(p) for p in glob.glob(version_file(server, 0).replace("000000000000", "*"))}
    (found,) = memfds() - before - kept
    return found


def test_the_next_publish_of_a_model_uses_the_upload_set_up_ahead(server, client):
    weights, before = mixed_model(1), memfds()
    client.publish(weights, model=MODEL, transport="shm")
    ahead = spare(server, before)
    weights = mixed_model(2)
    version = client.publish(weights, model=MODEL, transport="shm")
    assert identity_of(version_file(server, version)) == ahead  # it became the version's file
    assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)
    assert spare(server, before) != ahead  # and the next one is set up


def test_a_publish_takes_the_spare_still_being_set_up(server, client, monkeypatch):
    """The next publish comes while the last one's spare is still being set up: it waits for that
    spare rather than staging a second model-sized upload beside it."""
    prepare = SharedMemoryTransport.prepare

    def slow(self, payload):
        time.sleep(0.5)
        prepare(self, payload)

    monkeypatch.setattr(SharedMemoryTransport, "prepare", slow)
    before = memfds()
    client.publish(mixed_model(1), model=MODEL, transport="shm")
    ahead = spare(server, before)  # staged by the server, still being mapped by the client
    weights = mixed_model(2)
    version = client.publish(weights, model=MODEL, transport="shm")
    assert identity_of(version_file(server, version)) == ahead
    assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)


def test_a_child_forked_while_the_publisher_maps_its_upload_does_not_hold_the_seal(server, client, monkeypatch):
    """A process forked by the publisher (a collector, a data loader) while it maps its upload would
    inherit a writable mapping, and the seal would be refused for as long as the child lives: the
    mapping is not inherited (MADV_DONTFORK), so the publish commits."""
    prepare, children = SharedMemoryTransport.prepare, []

    def prepare_then_fork(self, payload):
        prepare(self, payload)
        pid = os.fork()
        if pid == 0:  # the child: only what is safe after a fork of a threaded process
            time.sleep(2)
            os._exit(0)
        children.append(pid)

    monkeypatch.setattr(SharedMemoryTransport, "prepare", prepare_then_fork)
    try:
        client.publish(mixed_model(1), model=MODEL, transport="shm")
        wait_until(lambda: children, what="the spare mapped, and a child forked")
        weights = mixed_model(2)
        version = client.publish(weights, model=MODEL, transport="shm")  # into the mapped spare
        assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)
        assert os.waitpid(children[0], os.WNOHANG) == (0, 0)  # the child still lived through the seal
    finally:
        for pid in children:
            os.waitpid(pid, 0)


def test_a_spare_of_another_size_is_let_go_and_the_publish_negotiates(server, client):
    before = memfds()
    client.publish(mixed_model(1), model=MODEL, transport="shm")
    ahead = spare(server, before)
    bigger = {**mixed_model(2), "extra": torch.ones(1000)}
    version = client.publish(bigger, model=MODEL, transport="shm")
    assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), bigger)
    assert identity_of(version_file(server, version)) != ahead  # unused: the server drops it when it expires


@pytest.mark.parametrize("transport", ["shm", "bulk"])
def test_a_spare_the_server_forgot_does_not_fail_the_publish(server, client, transport):
    """A server restart forgets every staged upload: the publish that used one negotiates again."""
    from tests.integration.test_fast_paths import servicer_of

    client.publish(mixed_model(1), model=MODEL, transport=transport)
    wait_equal(lambda: staged_count(server), 1, what="uploads staged")
    servicer_of(server).staged.close()  # what a restart does to them
    weights = mixed_model(2)
    version = client.publish(weights, model=MODEL, transport=transport)
    assert version == 2
    assert_bit_exact(client.fetch(MODEL, version=version, transport="stream").state_dict(), weights)
    assert [v.version for v in client.list_versions(MODEL)] == [1, 2]


def test_a_model_over_the_spare_limit_gets_no_spare(server, client, monkeypatch):
    """A spare holds a model's size of the server's memory: above MAX_SPARE_BYTES none is set up."""
    import weightclient.core.publish as publish

    weights = mixed_model(1)
    monkeypatch.setattr(publish, "MAX_SPARE_BYTES", len(file_of(weights)) - 1)
    for transport in ("shm", "bulk"):
        client.publish(weights, model=MODEL, transport=transport)
        time.sleep(0.3)  # a spare would be set up in the background by now
        assert staged_count(server) == 0
    monkeypatch.setattr(publish, "MAX_SPARE_BYTES", len(file_of(weights)))
    client.publish(weights, model=MODEL, transport="shm")
    wait_equal(lambda: staged_count(server), 1, what="uploads staged")  # at the limit: one is
