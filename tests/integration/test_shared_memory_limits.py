"""The shared-memory folder under pressure, with real server processes: a tmpfs too small for
the versions (the server must not die of SIGBUS; publishes and fetches go on without it), and
servers in other PID namespaces sharing one /dev/shm (none may remove a live server's folder)."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from launch import PrefixedServer

from weightclient import WeightClient
from weightserver.process import ServerProcess

MiB = 1 << 20
MODEL = "policy"
FULL_WARNING = "is full"


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (CI runs these tests as root)")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator:
    """mount_tmpfs(size_mib) -> a fresh tmpfs of that size, unmounted after the test."""
    require_root("mounting a small tmpfs")
    mounted: list[Path] = []

    def mount_tmpfs(size_mib: int) -> Path:
        target = tmp_path / f"shm{len(mounted)}"
        target.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=1777", "tmpfs", str(target)], check=True)
        mounted.append(target)
        return target

    try:
        yield mount_tmpfs
    finally:
        for target in mounted:
            subprocess.run(["umount", "-l", str(target)], check=False)


def weights(seed: int, size: int) -> dict[str, torch.Tensor]:
    """A model of `size` bytes whose content depends on `seed`."""
    return {"w": torch.arange(size // 4, dtype=torch.float32) + seed}


def fetch_exact(client: WeightClient, version: int, transport: str) -> tuple[str, torch.Tensor]:
    result = client.fetch(MODEL, version=version, transport=transport, timeout=60)
    return result.stats.transport, result.tensors["w"]


def test_publishes_beyond_a_full_shm_tmpfs_go_to_memory_and_the_server_lives(small_tmpfs):
    """64 MiB tmpfs, --keep 3, four 20 MiB versions: the fourth has no room in shared memory.
    Before the fix the server died of SIGBUS (rc -7) and every version was lost. Over bulk: the
    server writes those versions' files (a same-host publisher's memfd is not in the tmpfs)."""
    root = small_tmpfs(64)
    with ServerProcess("--shm-dir", str(root), "--keep", "3") as server, WeightClient(server.address) as client:
        versions = [client.publish(weights(seed, 20 * MiB), model=MODEL, transport="bulk") for seed in range(1, 5)]
        assert versions == [1, 2, 3, 4]
        assert server.process.poll() is None, server.log()
        with WeightClient(server.address) as other:  # other clients keep being served
            for version in (2, 3, 4):
                for transport in ("auto", "bulk", "stream", "shm"):
                    used, tensor = fetch_exact(other, version, transport)
                    assert torch.equal(tensor, weights(version, 20 * MiB)["w"]), (version, transport, used)
        # A fifth and sixth publish still commit (v4 went to memory; evictions make room again).
        assert client.publish(weights(5, 20 * MiB), model=MODEL, transport="bulk") == 5
        assert client.publish(weights(6, 20 * MiB), model=MODEL, transport="bulk") == 6
        assert [v.version for v in client.list_versions(MODEL)] == [4, 5, 6]
        for version in (4, 5, 6):
            assert torch.equal(fetch_exact(client, version, "auto")[1], weights(version, 20 * MiB)["w"])
        assert server.process.poll() is None
    log = server.log()
    assert log.count(FULL_WARNING) == 1, log  # once, however often it happens
    assert str(root) in log and "shm_size" in log and "--no-shm" in log and "64.0 MiB" in log


def test_a_version_larger_than_the_shm_tmpfs_is_published_and_fetched_over_the_network(small_tmpfs):
    """16 MiB tmpfs, one 32 MiB publish (Docker's default /dev/shm is 64 MiB): the publish is
    received into memory, and a fetch that asks for shared memory is offered the next transport."""
    root = small_tmpfs(16)
    with ServerProcess("--shm-dir", str(root)) as server, WeightClient(server.address) as client:
        # Over the stream: a fast publish would leave the next upload set up ahead among the
        # temp files checked below (the shared-memory publish: test_publish_transports).
        assert client.publish(weights(7, 32 * MiB), model=MODEL, transport="stream") == 1
        expected = weights(7, 32 * MiB)["w"]
        used, tensor = fetch_exact(client, 1, "auto")  # shm cannot be written: bulk is offered
        assert used == "bulk" and torch.equal(tensor, expected)
        used, tensor = fetch_exact(client, 1, "shm")  # shm alone: the stream
        assert used == "stream" and torch.equal(tensor, expected)
        cast = client.fetch(MODEL, version=1, dtype="BF16", transport="auto", timeout=60)  # a derived payload
        assert cast.stats.transport == "bulk" and torch.equal(cast.tensors["w"], expected.to(torch.bfloat16))
        # What fits still goes through shared memory.
        assert client.publish(weights(8, 4 * MiB), model="small", transport="stream") == 1
        result = client.fetch("small", version=1, transport="shm", timeout=60)
        assert result.stats.transport == "shm" and torch.equal(result.tensors["w"], weights(8, 4 * MiB)["w"])
        assert server.process.poll() is None
        leftovers = [p.name for p in root.rglob("*.tmp")]
        assert leftovers == [], leftovers  # no half-written file stays behind
    assert server.log().count(FULL_WARNING) == 1


# ---------------------------------------------------------------------- other PID namespaces
def server_folder(root: Path, pid: int) -> Path:
    (folder,) = root.glob(f"weightserver-*-{pid}")
    return folder


def test_a_server_in_another_pid_namespace_leaves_a_live_servers_folder_alone(tmp_path):
    """Server A runs; server C is SIGKILLed; server B starts in its own PID namespace on the
    same shared-memory root. B removes C's folder (nobody holds its lock) but not A's, and A
    still serves shared-memory fetches. Before the fix B judged by PID, saw no process A in its
    namespace, and deleted A's live folder."""
    require_root("unshare --pid")
    root = tmp_path / "shm"
    root.mkdir()
    expected = weights(1, MiB)["w"]
    with ServerProcess("--shm-dir", str(root)) as a, WeightClient(a.address) as client:
        client.publish(weights(1, MiB), model=MODEL)
        assert client.fetch(MODEL, transport="shm", timeout=30).stats.transport == "shm"
        a_folder = server_folder(root, a.process.pid)
        a_file = a_folder / MODEL / f"{1:012d}.safetensors"
        assert a_file.exists()

        killed = ServerProcess("--shm-dir", str(root)).start()
        with WeightClient(killed.address) as c:
            c.publish(weights(2, MiB), model=MODEL)
        killed_folder = server_folder(root, killed.process.pid)
        killed.kill()
        assert killed_folder.exists()  # SIGKILL: no chance to clean up

        # A container's view: no other process is visible.
        unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        b = PrefixedServer(tmp_path / "b", "--shm-dir", str(root), prefix=unshare)
        try:
            assert not killed_folder.exists(), "the SIGKILLed server's folder was not swept"
            assert a_folder.exists() and a_file.exists(), "a live server's folder was removed"
            with WeightClient(a.address) as other:
                result = other.fetch(MODEL, version=1, transport="shm", timeout=30)
                assert result.stats.transport == "shm" and torch.equal(result.tensors["w"], expected)
                assert other.publish(weights(3, MiB), model=MODEL) == 2
                assert other.fetch(MODEL, version=2, transport="shm", timeout=30).stats.transport == "shm"
            (b_folder,) = set(root.glob("weightserver-*")) - {a_folder}
            assert (b_folder / ".lock").exists()
        finally:
            assert b.stop() == 0, b.log()
        assert not b_folder.exists()  # a clean stop removes its own folder
        assert a_folder.exists()
    assert not a_folder.exists()


def test_a_folder_without_a_lock_file_is_left_alone(tmp_path):
    """A folder of a server from a release without lock files (alive or not, its PID means
    nothing in another namespace) is not removed; the log names it."""
    root = tmp_path / "shm"
    legacy = root / "weightserver-50051-0123abcd-999999"
    (legacy / MODEL).mkdir(parents=True)
    (legacy / MODEL / f"{1:012d}.safetensors").write_bytes(b"x")
    with ServerProcess("--shm-dir", str(root)) as server:
        assert legacy.exists()
        assert (legacy / MODEL / f"{1:012d}.safetensors").exists()
    assert "without a lock file" in server.log() and legacy.name in server.log()


def test_a_server_starting_beside_another_never_removes_the_folder_it_is_making(tmp_path, monkeypatch):
    """Two servers start at once on one host. The second one's scan for folders left by servers
    that are gone runs just as the first has made its folder and lock file, not yet locked. Before,
    that scan locked the file itself and removed the folder, or held it as the first server locked
    it (BlockingIOError: the server did not start). The lock file now takes its name only once locked."""
    from weightserver.transports.shared_memory import SharedMemoryFiles, server_shm_dir

    root = tmp_path / "shm"
    root.mkdir()
    real_flock, scans = fcntl.flock, []

    def flock(fd, operation):
        if not scans:  # the first server's own lock: the other server scans first
            scans.append(50052)
            server_shm_dir(50052, root)
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    folder = server_shm_dir(50051, root)
    files = SharedMemoryFiles(folder)
    try:
        assert scans, "the other server never scanned"
        assert (folder / ".lock").exists(), "the folder of a server that is starting was removed"
        server_shm_dir(50053, root)  # a later scan leaves it too: it is locked
        assert (folder / ".lock").exists()
        other = os.open(folder / ".lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                real_flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
        upload = files.new_upload(MODEL, 4096, publisher_writes=True)
        assert upload is not None
        upload.close()
    finally:
        files.close()


def test_an_upload_asked_for_as_the_server_stops_is_declined_quietly(tmp_path, caplog):
    """A publisher setting up its next upload while the server stops: the folder is gone, so no
    upload and no warning about writing a publish; the folder is not made again (it was, and left
    behind)."""
    from weightserver.transports.shared_memory import SharedMemoryFiles

    files = SharedMemoryFiles(tmp_path / "weightserver-test")
    before = files.new_upload("policy", 4096, publisher_writes=True)
    assert before is not None  # (open: it works)
    before.close()
    files.close()
    with caplog.at_level("DEBUG", logger="weightserver"):
        assert files.new_upload("policy", 4096, publisher_writes=True) is None
        assert files.new_upload("policy", 4096) is None
    assert not (tmp_path / "weightserver-test").exists()
    assert "cannot write" not in caplog.text


def test_a_server_whose_shm_folder_does_not_exist_serves_without_shared_memory(make_server, tmp_path, caplog):
    """`--shm-dir` naming no folder (or the default /dev/shm on a host without one) leaves shared
    memory off with a warning, as `server_shm_dir` says; publishes and fetches stream. Before, the
    start failed with AttributeError ('NoneType' object has no attribute 'mkdir'): a traceback."""
    server = make_server(shm_dir=tmp_path / "missing")
    assert server.shared_memory is None
    assert "does not exist; same-host fetches will stream" in caplog.text
    with WeightClient(server.address) as client:
        client.publish({"w": torch.ones(4)}, model=MODEL)
        fetched = client.fetch(MODEL)
    assert torch.equal(fetched.tensors["w"], torch.ones(4)) and fetched.stats.transport != "shm"


def test_a_start_that_fails_at_the_shm_folder_lets_the_bulk_port_go(tmp_path):
    """A shared-memory folder the server cannot make (here a read-only tmpfs; for another user, one
    it may not write) fails the start with its OSError, and the bulk endpoint opened just before
    is closed. Before, that endpoint was made outside the `try` whose `finally` closes it: its port
    stayed bound and its threads ran for the life of the process."""
    import socket

    from weightserver import ServerConfig, WeightServer

    require_root("mounting a read-only tmpfs")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], check=True)
    try:
        server = WeightServer(ServerConfig(host="127.0.0.1", port=0, shm_dir=read_only))
        with pytest.raises(OSError, match="Read-only file system"):
            server.start()
    finally:
        subprocess.run(["umount", str(read_only)], check=True)
    assert server.bulk is not None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.bulk.port), timeout=5).close()
