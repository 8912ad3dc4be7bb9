"""The server owns a committed version's bytes (issue 29, items 1-3).

A same-host publisher writes a model into a shared-memory file named by Negotiate; the server
copies what it is told is written into a file of its own and verifies that copy. Here, over raw
stubs and against a real server process (so that a SIGBUS shows as the process dying), the
publisher's file is cut short, changed after the commit through a descriptor or mapping it kept,
and changed between `written` and `uploaded`: the publish fails with DATA_LOSS or the server
serves exactly the bytes whose digests it recorded, and it stays up.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
import xxhash

import weightserver.publish.receiver as receiver
from tests.integration.test_publish_transports import SHM, file_of
from tests.waiting import wait_for
from weightserver.process import ServerProcess
from weightserver.protocol.errors import IntegrityError
from weightserver.publish.staged_uploads import StagedUploads
from weightserver.transports.shared_memory import SharedMemoryFiles
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


# ---------------------------------------------------------------------- 1: a file cut short
@pytest.mark.parametrize("announced", [False, True], ids=["uploaded", "written-then-uploaded"])
def test_an_upload_file_cut_short_is_data_loss_not_a_crash(tmp_path, announced):
    data = model_file(1.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(data))
        path = answer.payload.shared_memory.path
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
        assert not os.path.exists(path)  # the publisher's file goes with the publish
        # Nothing was committed, and the server takes the next publish.
        with pytest.raises(grpc.RpcError) as missing:
            stub.ListVersions(pb.ListVersionsRequest(model=MODEL), timeout=TIMEOUT)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        header, answer = shm_upload(stub, len(data))
        with open(answer.payload.shared_memory.path, "r+b") as f:
            f.write(data)
        messages = [
            pb.PublishRequest(header=header),
            *uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data)),
        ]
        assert stub.Publish(iter(messages), timeout=TIMEOUT).version.version == 1
        assert_served(stub, 1, data)


# ---------------------------------------------------------------------- 2: changed after the commit
@pytest.mark.parametrize("change", ["pwrite", "truncate", "mapping"])
def test_a_committed_version_cannot_be_changed_through_what_the_publisher_kept(tmp_path, change):
    """The publisher keeps the descriptor (or a shared writable mapping) it wrote its file with,
    and uses it after the commit: the version served stays the one committed."""
    data, other = model_file(1.0), model_file(2.0)
    with serving(tmp_path) as (server, stub):
        header, answer = shm_upload(stub, len(data))
        fd = os.open(answer.payload.shared_memory.path, os.O_RDWR)
        kept = mmap.mmap(fd, len(data))
        try:
            assert os.pwrite(fd, data, 0) == len(data)
            messages = [
                pb.PublishRequest(header=header),
                *uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(data)),
            ]
            assert stub.Publish(iter(messages), timeout=TIMEOUT).version.version == 1
            if change == "pwrite":
                assert os.pwrite(fd, other[-4096:], len(data) - 4096) == 4096
            elif change == "truncate":
                os.ftruncate(fd, 0)
            else:
                kept[len(data) - 4096 :] = other[-4096:]
            assert_served(stub, 1, data)
            assert_up(server)
        finally:
            kept.close()
            os.close(fd)


# ---------------------------------------------------------------------- 3: changed after `written`
def test_what_the_server_verifies_is_what_it_serves(tmp_path):
    """All of file A is announced as written, then the file is overwritten with B before
    `uploaded` names A's xxh3. Once the announced bytes have landed at the server (a cut-through
    fetch received them all), the version is A whatever the file holds, and served as A."""
    a, b = model_file(1.0), model_file(2.0)
    with serving(tmp_path) as (server, stub):
        events = stub.Watch(pb.WatchRequest(model=MODEL, incoming=True), timeout=TIMEOUT)
        header, answer = shm_upload(stub, len(a))
        with open(answer.payload.shared_memory.path, "r+b") as f:
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
            event = next(events)
            assert event.incoming.id and not event.HasField("version")
            arrived = b"".join(
                m.chunk
                for m in stub.Fetch(pb.FetchRequest(model=MODEL, incoming=event.incoming.id), timeout=TIMEOUT)
                if m.WhichOneof("kind") == "chunk"
            )
            assert arrived == a  # every announced byte has landed at the server
            with open(answer.payload.shared_memory.path, "r+b") as f:
                f.write(b)
            for message in uploaded_and_commit(answer.upload, xxhash.xxh3_128_hexdigest(a)):
                requests.put(message)
            requests.put(None)
            thread.join(TIMEOUT)
        finally:
            requests.put(None)
            events.cancel()
        assert_up(server)
        (reply,) = replies
        assert isinstance(reply, pb.PublishResponse), reply
        assert reply.version.version == 1 and reply.version.xxh3 == xxhash.xxh3_128_hexdigest(a)
        assert_served(stub, 1, a)


# ---------------------------------------------------------------------- the copy itself
@pytest.mark.parametrize("threads", [0, 3], ids=["inline", "threads"])
def test_the_server_copies_the_writers_file_and_verifies_its_copy(tmp_path, monkeypatch, threads):
    """Inline (two CPUs or fewer) or spread over copying threads: the upload's buffer ends up
    holding the writer's bytes and the digests are of them; a file cut short is an
    IntegrityError; the writer's file is removed either way."""
    pool = ThreadPoolExecutor(threads) if threads else None
    monkeypatch.setattr(receiver, "_copying", lambda: pool)
    files, uploads = SharedMemoryFiles(tmp_path / "shm"), StagedUploads({})
    data = model_file(1.0)  # several copy blocks
    try:
        whole = uploads.create(
            MODEL, len(data), "shm", lambda: files.new_upload(MODEL, len(data), publisher_writes=True)
        )
        assert whole.file is not None and whole.file.source is not None
        whole.file.source.path.write_bytes(data)
        whole.written(len(data) // 3)
        digests = whole.finish()
        assert digests.xxh3 == xxhash.xxh3_128_hexdigest(data) and bytes(whole.buffer) == data
        assert not whole.file.source.path.exists()
        whole.discard()

        short = uploads.create(
            MODEL, len(data), "shm", lambda: files.new_upload(MODEL, len(data), publisher_writes=True)
        )
        assert short.file is not None and short.file.source is not None
        short.file.source.path.write_bytes(data[: len(data) // 2])
        short.written(len(data))
        with pytest.raises(IntegrityError, match="cut short"):
            short.finish()
        assert not short.file.source.path.exists()
        short.discard()
        assert not list((tmp_path / "shm").rglob("*.tmp"))
    finally:
        uploads.close()
        files.close()
        if pool is not None:
            pool.shutdown()
