"""The server owns a committed version's bytes (issue 29, items 1-3).

A same-host publisher writes a model into a memfd of the server's, named by Negotiate as
/proc/<server pid>/fd/<n>; at `uploaded` the server seals it (no write, grow or shrink by anyone)
and only then reads and hashes it, or (every digest declared at `uploaded`) commits it unread and
checks the digests after the commit. Here, over raw stubs and against a real server process (so
that a SIGBUS shows as the process dying), the publisher's upload is cut short, changed after the
commit through a descriptor it kept, kept mapped for writing across the commit, and changed
between `written` and `uploaded`: the publish fails with a status that says why, or the server
serves exactly the bytes whose digests it recorded, and it stays up.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import xxhash

from tests.integration.test_publish_transports import SHM, file_of, identity_of, released
from tests.waiting import wait_for
from weightserver.process import ServerProcess
from weightserver.protocol.safetensors_format import parse_header
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
TIMEOUT = 30


def model_file(fill: float) -> bytes:
    """A 4 MiB safetensors file; files of different `fill` have the same size and header."""
    return file_of({"w": torch.full((1 << 20,), fill)})


@contextlib.contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[ServerProcess, pb_grpc.WeightServiceStub]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    server = ServerProcess("--shm-dir", str(shm)).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield server, pb_grpc.WeightServiceStub(channel)
    finally:
        server.kill()


def alive(server: ServerProcess) -> bool:
    assert server.process is not None
    return server.process.poll() is None


def assert_up(server: ServerProcess) -> None:
    assert alive(server), f"the server died (exit code {server.process.returncode}):\n{server.log()[-3000:]}"


def stream_fetch(stub: pb_grpc.WeightServiceStub, version: int) -> tuple[pb.VersionInfo, bytes]:
    """The version's header and bytes over the Fetch stream (what the server serves)."""
    info, chunks = None, []
    for message in stub.Fetch(pb.FetchRequest(model=MODEL, version=version), timeout=TIMEOUT):
        if message.WhichOneof("kind") == "header":
            info = message.header
        elif message.WhichOneof("kind") == "chunk":
            chunks.append(message.chunk)
    assert info is not None
    return info, b"".join(chunks)


def assert_served(stub: pb_grpc.WeightServiceStub, version: int, expected: bytes) -> None:
    """The server serves `expected` as `version`, with the digests of the bytes it serves."""
    sha256 = wait_for(
        lambda: stub.Describe(pb.DescribeRequest(model=MODEL, version=version), timeout=TIMEOUT).sha256,
        what="the version's sha256, computed after its commit",
    )
    info, data = stream_fetch(stub, version)
    assert xxhash.xxh3_128_hexdigest(data) == info.xxh3, "the bytes served do not match the xxh3 recorded"
    assert hashlib.sha256(data).hexdigest() == sha256, "the bytes served do not match the sha256 recorded"
    assert data == expected


def shm_upload(stub: pb_grpc.WeightServiceStub, size: int) -> tuple[pb.PublishHeader, pb.NegotiateResponse]:
    header = pb.PublishHeader(model=MODEL, total_bytes=size)
    answer = stub.Negotiate(pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH, accept=[SHM], publish=header))
    assert answer.transport == SHM
    return header, answer


def uploaded_and_commit(upload: str, xxh3: str) -> list[pb.PublishRequest]:
    return [
        pb.PublishRequest(uploaded=pb.PublishUploaded(upload=upload, xxh3=xxh3)),
        pb.PublishRequest(commit=pb.PublishCommit()),
    ]


def publish_honestly(stub: pb_grpc.WeightServiceStub, data: bytes) -> None:
    """`data` written into a new upload, which commits as v1 and is served as written."""
    header, answer = shm_upload(stub, len(data))
    with open(answer.payload.shared_memory.path, "r+b") as f:
        f.write(data)
    messages = [pb.PublishRequest(header=header), *uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data))]
    assert stub.Publish(iter(messages), timeout=TIMEOUT).version.version == 1
    assert_served(stub, 1, data)


# ---------------------------------------------------------------------- 1: a file cut short
@pytest.mark.parametrize("announced", [False, True], ids=["uploaded", "written-then-uploaded"])
def test_an_upload_file_cut_short_is_data_loss_not_a_crash(tmp_path, announced):
    data = model_file(1.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(data))
        path = answer.payload.shared_memory.path
        identity = identity_of(path)
        with open(path, "wb") as f:  # "wb" shortens the file to what is written
            f.write(data[: len(data) // 2])
        messages = [pb.PublishRequest(header=header)]
        if announced:
            messages.append(pb.PublishRequest(written=pb.PublishWritten(upload=answer.upload, end=len(data))))
        messages += uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data))
        with pytest.raises(grpc.RpcError) as caught:
            stub.Publish(iter(messages), timeout=TIMEOUT)
        assert_up(server)
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS, caught.value.details()
        assert "cut short" in caught.value.details()
        # Nothing was committed, and the server takes the next publish.
        with pytest.raises(grpc.RpcError) as missing:
            stub.ListVersions(pb.ListVersionsRequest(model=MODEL), timeout=TIMEOUT)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert released(path, identity)  # the server let go of the upload with the publish
        publish_honestly(stub, data)  # and the server takes the next publish


# ---------------------------------------------------------------------- 2: changed after the commit
@pytest.mark.parametrize("change", ["pwrite", "truncate", "reopen"])
def test_a_committed_version_cannot_be_changed_through_what_the_publisher_kept(tmp_path, change):
    """The publisher keeps the descriptor it wrote with (or opens the path again) and, after the
    commit, writes or truncates: the kernel refuses (the seal), and the version served stays the
    one committed."""
    data, other = model_file(1.0), model_file(2.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(data))
        fd = os.open(answer.payload.shared_memory.path, os.O_RDWR)
        try:
            assert os.pwrite(fd, data, 0) == len(data)
            messages = [
                pb.PublishRequest(header=header),
                *uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data)),
            ]
            assert stub.Publish(iter(messages), timeout=TIMEOUT).version.version == 1
            with pytest.raises(PermissionError):
                if change == "pwrite":
                    os.pwrite(fd, other[-4096:], len(data) - 4096)
                elif change == "truncate":
                    os.ftruncate(fd, 0)
                else:
                    mmap.mmap(os.open(f"/proc/self/fd/{fd}", os.O_RDWR), len(data))  # opened again, mapped
            assert_served(stub, 1, data)
            assert_up(server)
        finally:
            os.close(fd)


def test_an_upload_still_mapped_for_writing_is_refused_not_committed(tmp_path):
    """A publisher that keeps a writable mapping across `uploaded` could change the bytes after the
    commit: the seal fails, the publish gets INVALID_ARGUMENT saying to unmap, and the next one,
    unmapped, commits."""
    data = model_file(1.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(data))
        fd = os.open(answer.payload.shared_memory.path, os.O_RDWR)
        kept = mmap.mmap(fd, len(data))
        os.close(fd)
        try:
            kept[:] = data
            messages = [
                pb.PublishRequest(header=header),
                *uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data)),
            ]
            with pytest.raises(grpc.RpcError) as caught:
                stub.Publish(iter(messages), timeout=TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert "unmap it" in caught.value.details()
        finally:
            kept.close()
        assert_up(server)
        publish_honestly(stub, data)  # and the server takes the next publish


@pytest.mark.parametrize("seals", ["against-new-seals-only", "whole"])
def test_an_upload_the_publisher_sealed_itself_is_a_status_not_an_internal_error(tmp_path, seals):
    """The publisher adds seals to its upload before `uploaded`, F_SEAL_SEAL among them: the
    server's own seal is refused (EPERM), which was INTERNAL ("PermissionError; see the server
    log"). An upload the publisher sealed against writes, growth and shrinking cannot change, so
    it commits; one still writable is INVALID_ARGUMENT saying to add no seals."""
    data = model_file(1.0)
    added = fcntl.F_SEAL_SEAL
    if seals == "whole":
        added |= fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(data))
        fd = os.open(answer.payload.shared_memory.path, os.O_RDWR)
        try:
            assert os.pwrite(fd, data, 0) == len(data)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, added)
        finally:
            os.close(fd)
        messages = [
            pb.PublishRequest(header=header),
            *uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data)),
        ]
        if seals == "whole":
            assert stub.Publish(iter(messages), timeout=TIMEOUT).version.version == 1
            assert_served(stub, 1, data)
        else:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Publish(iter(messages), timeout=TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert "add no seals" in caught.value.details()
            publish_honestly(stub, data)  # and the server takes the next publish
        assert_up(server)


# ---------------------------------------------------------------------- 3: changed after `written`
@pytest.mark.parametrize("declared", ["a", "b"])
def test_what_the_server_verifies_is_what_it_serves(tmp_path, declared):
    """All of file A is announced as written, then the upload is overwritten with B before
    `uploaded`. The server reads nothing before its seal, so the version is what the upload holds
    then: `uploaded` naming A's xxh3 is DATA_LOSS; naming B's commits B, served as B."""
    a, b = model_file(1.0), model_file(2.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(a))
        path = answer.payload.shared_memory.path
        with open(path, "r+b") as f:
            f.write(a)
        requests: queue.Queue[pb.PublishRequest | None] = queue.Queue()
        requests.put(pb.PublishRequest(header=header))
        requests.put(pb.PublishRequest(written=pb.PublishWritten(upload=answer.upload, end=len(a))))
        replies: list[object] = []

        def publish() -> None:
            try:
                replies.append(stub.Publish(iter(requests.get, None), timeout=TIMEOUT))
            except grpc.RpcError as exc:
                replies.append(exc)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        try:
            with open(path, "r+b") as f:
                f.write(b)
            digest = xxhash.xxh3_128_hexdigest(a if declared == "a" else b)
            for message in uploaded_and_commit(answer.upload, digest):
                requests.put(message)
            requests.put(None)
            thread.join(TIMEOUT)
        finally:
            requests.put(None)
        assert_up(server)
        (reply,) = replies
        if declared == "a":
            assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.DATA_LOSS, reply
            assert "xxh3" in reply.details()
            return
        assert isinstance(reply, pb.PublishResponse), reply
        assert reply.version.version == 1 and reply.version.xxh3 == xxhash.xxh3_128_hexdigest(b)
        assert_served(stub, 1, b)


# ---------------------------------------------------------------------- digests declared at `uploaded`
def tensor_digests_of(data: bytes) -> dict[str, str]:
    header = parse_header(data)
    return {
        t.name: xxhash.xxh3_128_hexdigest(data[header.data_start + t.begin : header.data_start + t.end])
        for t in header.tensors
    }


@pytest.mark.parametrize("honest", [True, False], ids=["honest", "declares-another-files-digests"])
def test_declared_digests_commit_unread_and_are_checked_after_the_commit(tmp_path, honest):
    """`uploaded` with the file's and every tensor's xxh3: the sealed upload commits with them,
    unread. The server checks them after the commit: a publisher that declared file A's digests
    but wrote B gets B committed (its bytes were sealed), and within the sha256 pass the version's
    digests become B's own, with an ERROR naming the version; an honest one's stay as declared."""
    a, b = model_file(1.0), model_file(2.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(b))
        with open(answer.payload.shared_memory.path, "r+b") as f:
            f.write(b)
        declared = b if honest else a
        done = pb.PublishUploaded(
            upload=answer.upload, xxh3=xxhash.xxh3_128_hexdigest(declared), tensor_xxh3=tensor_digests_of(declared)
        )
        messages = [pb.PublishRequest(header=header), pb.PublishRequest(uploaded=done)]
        reply = stub.Publish(iter([*messages, pb.PublishRequest(commit=pb.PublishCommit())]), timeout=TIMEOUT)
        assert reply.version.xxh3 == xxhash.xxh3_128_hexdigest(declared), "committed with the digests declared"
        assert {t.name: t.xxh3 for t in reply.version.tensors} == tensor_digests_of(declared)
        assert_served(stub, 1, b)  # waits for the pass after the commit; the digests are then B's
        described = stub.Describe(pb.DescribeRequest(model=MODEL, version=1), timeout=TIMEOUT)
        assert {t.name: t.xxh3 for t in described.tensors} == tensor_digests_of(b)
        assert_up(server)
        complaint = "its publisher declared digests that do not match its bytes"
        if honest:
            assert complaint not in server.log()
        else:
            wait_for(lambda: complaint in server.log(), what="the ERROR about the declared digests")
            assert "model 'policy' v1" in server.log()


def test_a_large_upload_given_up_an_eighth_at_a_time_commits_whole(tmp_path, monkeypatch):
    """From 64 MiB the client unmaps each eighth of its upload mapping once copied and hashed,
    while it writes the rest (`page_tables.unmap`, counted here): the seal then finds no writable
    mapping, the declared digests are the bytes' own (no ERROR from the check after the commit), and
    a fetch over the stream, checked against them, gets every tensor back."""
    from weightclient import WeightClient
    from weightserver.protocol import page_tables

    unmapped: list[int] = []
    original = page_tables.unmap

    def counted(mapping, start, end):
        unmapped.append(end - start)
        original(mapping, start, end)

    monkeypatch.setattr(page_tables, "unmap", counted)
    weights = {"a": torch.arange(10 << 20, dtype=torch.float32), "b": torch.full((9 << 20,), 2.5)}  # 76 MiB
    with serving(tmp_path) as (server, stub), WeightClient(server.address) as client:
        versions = [client.publish(weights, model=MODEL, transport="shm")]
        while not unmapped and len(versions) < 6:  # the next publishes find the upload set up ahead
            time.sleep(0.5)
            versions.append(client.publish(weights, model=MODEL, transport="shm"))
        assert unmapped and sum(unmapped) >= 5 * (76 << 20) // 8, unmapped
        assert_up(server)
        for version in versions:
            fetched = client.fetch(MODEL, version=version, transport="stream")
            assert all(torch.equal(fetched.weights[k], v) for k, v in weights.items())
            wait_for(lambda v=version: stub.Describe(pb.DescribeRequest(model=MODEL, version=v)).sha256, what="sha256")
        log = server.log()
        assert "transport=shm" in log and "do not match its bytes" not in log
