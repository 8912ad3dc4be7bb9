"""A full data disk (issue 14, item 4), on a small tmpfs mounted as --data-dir of a real server
process: a publish that does not fit leaves no partial file and gets RESOURCE_EXHAUSTED with a
message that names the directory and what to do; readers keep being served; deleting versions
works on the full disk and frees space; a deleted version stays deleted, and its number unused,
across a restart. Needs root (to mount the tmpfs)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from weightclient import NotFoundError, StorageFull, VersionNotFound, WeightServiceClient
from weightserver.process import ServerProcess
from weightserver.protocol.safetensors_format import build_header

MODEL = "policy"
VERSION_BYTES = 256 * 1024


@contextmanager
def tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's size=, e.g. "4m") at `tmp_path`/disk, unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs as the full data disk needs root")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted after the test."""
    with tmpfs(tmp_path, "4m") as mount_point:
        yield mount_point


def payload(n: int, size: int = VERSION_BYTES) -> bytes:
    prefix, _ = build_header([("w", "U8", (size,), size)])
    return prefix + n.to_bytes(4, "little") * (size // 4)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill(mount_point: Path, leave: int) -> None:
    """Fill the disk with another file until `leave` bytes are free (0: completely)."""
    with open(mount_point / "filler", "ab") as filler:
        while free_bytes(mount_point) > leave:
            try:
                filler.write(b"\0" * max(4096, min(1 << 20, free_bytes(mount_point) - leave)))
                filler.flush()
            except OSError:
                break


def assert_storage_full(client: WeightServiceClient, data_dir: Path, data: bytes) -> None:
    with pytest.raises(StorageFull) as caught:
        client.publish_bytes(MODEL, data)
    message = str(caught.value)
    assert str(data_dir) in message and "is full" in message
    assert "delet" in message and "--keep" in message and "more space" in message


def test_a_full_data_disk_refuses_publishes_and_deletes_free_it(small_disk: Path) -> None:
    data_dir = small_disk / "data"
    server = ServerProcess("--data-dir", str(data_dir), "--keep", "100").start()
    try:
        published = {}
        with WeightServiceClient(server.address) as client, WeightServiceClient(server.address) as reader:
            for n in (1, 2, 3):
                published[client.publish_bytes(MODEL, payload(n)).version] = payload(n)
            assert sorted(published) == [1, 2, 3]

            # Half a version's room left: the write starts, fails, and leaves nothing behind.
            fill(small_disk, leave=VERSION_BYTES // 2)
            before = free_bytes(small_disk)
            assert_storage_full(client, data_dir, payload(4))
            assert free_bytes(small_disk) == before
            assert not list(data_dir.rglob("*.tmp"))

            # No room at all: every publish, however small, is refused the same way.
            fill(small_disk, leave=0)
            for data in (payload(5), payload(6, size=8)):
                assert_storage_full(client, data_dir, data)
            assert not list(data_dir.rglob("*.tmp"))

            # Readers are served all along.
            assert reader.latest(MODEL).version == 3
            for version, data in published.items():
                assert bytes(reader.fetch_bytes(MODEL, version=version, transport="stream").data) == data

            # Deleting works on the full disk (the latest too) and frees the space.
            assert client.delete(MODEL, 3).version == 3
            assert client.delete(MODEL, 1).version == 1
            assert free_bytes(small_disk) >= 2 * VERSION_BYTES
            for gone in (1, 3):
                with pytest.raises(VersionNotFound):
                    reader.fetch_bytes(MODEL, version=gone)
            new = client.publish_bytes(MODEL, payload(7)).version
            assert new == 4  # never 3 again
        server.kill()  # as in a crash: no chance to tidy up
        server.start()
        with WeightServiceClient(server.address) as client:
            assert [v.version for v in client.list_versions(MODEL)] == [2, 4]
            for gone in (1, 3):
                with pytest.raises(NotFoundError):  # v1, below the oldest retained, reads as evicted
                    client.fetch_bytes(MODEL, version=gone)
            assert bytes(client.fetch_bytes(MODEL, version=4, transport="stream").data) == payload(7)
            (small_disk / "filler").unlink()
            assert client.publish_bytes(MODEL, payload(8)).version == 5
        assert sorted(p.name for p in (data_dir / MODEL).iterdir()) == sorted(
            [f"{v:012d}{suffix}" for v in (2, 4, 5) for suffix in (".json", ".safetensors")] + ["high_water.json"]
        )
    finally:
        server.kill()
