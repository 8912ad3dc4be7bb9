"""The two-thread block reader behind placed shared-memory fetches: every block lands with
the file's bytes, `landed` sees blocks in file order and only once they are in place, a short
file raises without leaving a helper read in flight, and it works alone, concurrently and
after a fork."""

from __future__ import annotations

import os
import threading
import time

import pytest

from weightclient.transports import block_reader
from weightclient.transports.block_reader import read_blocks
from weightserver.protocol import cpus as usable

BLOCK = 64 << 10


def write_file(path, nbytes: int, seed: int = 0) -> bytes:
    data = bytes((seed + i * 7) % 251 for i in range(nbytes))
    path.write_bytes(data)
    return data


def plan(nbytes: int, start: int = 0) -> tuple[bytearray, list[tuple[memoryview, int]]]:
    """A destination buffer and its blocks: uneven sizes, the last one partial."""
    target = bytearray(nbytes - start)
    view, blocks, offset = memoryview(target), [], start
    while offset < nbytes:
        size = min(BLOCK + (offset // BLOCK) % 3 * 4096, nbytes - offset)
        blocks.append((view[offset - start : offset - start + size], offset))
        offset += size
    return target, blocks


def read_checked(fd: int, data: bytes, blocks: list[tuple[memoryview, int]]) -> list[int]:
    order: list[int] = []

    def landed(i: int) -> None:
        view, offset = blocks[i]
        assert bytes(view) == data[offset : offset + view.nbytes], f"block {i} not in place when landed"
        order.append(i)

    read_blocks(fd, blocks, landed)
    return order


def read_path(path, data: bytes, blocks: list[tuple[memoryview, int]]) -> list[int]:
    """read_checked on the file at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_checked(fd, data, blocks)
    finally:
        os.close(fd)


@pytest.mark.parametrize("cpus", [1, 2])
def test_every_block_lands_with_the_files_bytes_in_order(tmp_path, monkeypatch, cpus):
    monkeypatch.setattr(usable, "usable_cpus", lambda: cpus)
    if cpus == 1:
        monkeypatch.setattr(block_reader, "_helper_pool", lambda: pytest.fail("one CPU needs no helper"))
    helper_reads: list[int] = []
    if cpus == 2:  # a slow helper: the caller runs out of blocks to claim and must wait for its reads
        pread = block_reader.pread_exactly
        helper_started = threading.Event()

        def slow_in_helper(fd: int, view: memoryview, offset: int) -> None:
            if threading.current_thread().name.startswith("weightclient-read"):
                helper_started.set()
                time.sleep(0.01)
                helper_reads.append(offset)
            else:  # on a busy machine the caller could claim every block before the helper starts
                helper_started.wait(timeout=5)
            pread(fd, view, offset)

        monkeypatch.setattr(block_reader, "pread_exactly", slow_in_helper)
    data = write_file(tmp_path / "f", 40 * BLOCK + 123)
    target, blocks = plan(len(data), start=8)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert read_checked(fd, data, blocks) == list(range(len(blocks)))
    finally:
        os.close(fd)
    assert bytes(target) == data[8:]
    assert bool(helper_reads) == (cpus == 2)


def test_a_few_blocks_are_read_by_the_caller_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(block_reader, "_helper_pool", lambda: pytest.fail("too few blocks for a helper"))
    data = write_file(tmp_path / "f", 2 * BLOCK)
    target, blocks = plan(len(data))
    assert read_path(tmp_path / "f", data, blocks) == list(range(len(blocks)))
    assert bytes(target) == data


@pytest.mark.parametrize("cpus", [1, 2])
def test_a_short_file_raises_and_leaves_no_read_in_flight(tmp_path, monkeypatch, cpus):
    monkeypatch.setattr(usable, "usable_cpus", lambda: cpus)
    data = write_file(tmp_path / "f", 40 * BLOCK)
    _, blocks = plan(len(data) + 5 * BLOCK)  # the plan wants 5 blocks more than the file has
    seen: list[int] = []
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="ended before"):
            read_blocks(fd, blocks, seen.append)
    finally:
        os.close(fd)
    assert seen == list(range(len(seen))) and len(seen) < len(blocks)
    # The helper is free again (nothing of this read is left queued or running): it reads blocks of the next one.
    readers: set[str] = set()
    pread = block_reader.pread_exactly

    def noted(fd: int, view: memoryview, offset: int) -> None:
        readers.add(threading.current_thread().name)
        time.sleep(0.001)  # leaves the helper time to claim blocks too
        pread(fd, view, offset)

    monkeypatch.setattr(block_reader, "pread_exactly", noted)
    _, blocks = plan(len(data))
    assert read_path(tmp_path / "f", data, blocks) == list(range(len(blocks)))
    assert any(name.startswith("weightclient-read") for name in readers) == (cpus == 2), readers


def test_concurrent_reads_share_the_helper_and_stay_correct(tmp_path, monkeypatch):
    monkeypatch.setattr(usable, "usable_cpus", lambda: 2)
    files = [write_file(tmp_path / f"f{i}", 30 * BLOCK + i, seed=i) for i in range(4)]
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        try:
            for _ in range(5):
                target, blocks = plan(len(files[i]))
                fd = os.open(tmp_path / f"f{i}", os.O_RDONLY)
                try:
                    assert read_checked(fd, files[i], blocks) == list(range(len(blocks)))
                finally:
                    os.close(fd)
                assert bytes(target) == files[i]
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)


def test_a_forked_child_reads_with_a_helper_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(usable, "usable_cpus", lambda: 2)
    data = write_file(tmp_path / "f", 20 * BLOCK)
    _, blocks = plan(len(data))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        read_checked(fd, data, blocks)  # the parent's helper thread exists now
        pid = os.fork()
        if pid == 0:  # the child: a helper thread of its own, else the read would still be right
            code = 1
            try:
                target, blocks = plan(len(data))
                read_checked(fd, data, blocks)
                # (threads do not survive a fork: a helper thread here is the child's own)
                fresh = any(t.name.startswith("weightclient-read") for t in threading.enumerate())
                code = 0 if bytes(target) == data and fresh else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
