"""How the server takes a same-host publisher's bytes: the cost of owning them (issue 29).

    .venv/bin/python -m bench.shm_copy [--size 256MiB] [--count 10] [--ways map,pread,server]

A profile without gRPC: a writer process writes a safetensors file into an upload file as the
client does (into a mapping filled ahead, 256 KiB blocks, each hashed), saying every
sixteenth how far it has got; this process takes each stretch as it is told, one of these ways:

- `map`: hash the writer's file through a mapping of it, a block at a time (the server before
  issue 29, in one thread: no copy, but the writer can change the bytes after they are
  verified, and a file cut short is a SIGBUS);
- `pread`: pread each block into the server's own file through its mapping (filled ahead),
  then hash it there: one copy, in one thread;
- `server`: what the server does (`StagedUpload.written`, then `finish`): the same copy, the
  blocks spread over `staged_uploads.COPY_THREADS` threads, hashed in order (whole file and
  per tensor) in the upload's own thread.

Prints, per way, the medians of the writer's time, of the time until the server has every
digest (the publish's critical path; "tail": how long after the writer), and of the server's
CPU time. Measured on a 16-core machine (H200 host), the server's one-thread copy ran at about
half a writer's speed: hence the threads.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import xxhash

from bench.common import format_size, parse_size
from weightserver.protocol import page_tables
from weightserver.protocol.digests import IncomingDigests
from weightserver.publish.staged_uploads import StagedUploads
from weightserver.transports.shared_memory import SharedMemoryFiles

WRITE_BLOCK = 256 << 10
BLOCK = 1 << 20
PARTS = 16


def safetensors_file(size: int) -> bytes:
    """A valid safetensors file of exactly `size` bytes: one U8 tensor."""
    for data in range(size - 64, 0, -1):
        header = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).encode()
        header += b" " * (-len(header) % 8)
        if 8 + len(header) + data == size:
            return len(header).to_bytes(8, "little") + header + bytes(range(256)) * (data // 256) + bytes(data % 256)
    raise ValueError(size)


def writer(path: str, size: int, conn: Connection) -> None:
    """The publisher, in a process of its own: told to start, writes and says how far."""
    content = safetensors_file(size)
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, size)
    os.close(fd)
    page_tables.populate(mapping)  # a spare upload, prepared ahead
    target, data, hasher = memoryview(mapping), memoryview(content), xxhash.xxh3_128()
    step, said = max(4 << 20, size // PARTS), 0
    conn.send("ready")
    conn.recv()
    for offset in range(0, size, WRITE_BLOCK):
        block = data[offset : offset + WRITE_BLOCK]
        target[offset : offset + block.nbytes] = block
        hasher.update(block)
        done = offset + block.nbytes
        if done >= said + step or done == size:
            conn.send(done)
            said = done
    conn.send(time.perf_counter())  # CLOCK_MONOTONIC: the same clock in both processes
    target.release()
    mapping.close()


def trial(way: str, size: int, folder: Path) -> tuple[float, float, float]:
    files = SharedMemoryFiles(folder / "server")
    uploads = StagedUploads({})
    upload = uploads.create("m", size, "shm", lambda: files.new_upload("m", size, populate=True, publisher_writes=True))
    assert upload.file is not None and upload.file.source is not None
    source_path = str(upload.file.source.path)
    source = os.open(source_path, os.O_RDONLY)
    theirs = mmap.mmap(source, size, prot=mmap.PROT_READ) if way == "map" else None
    conn, theirs_conn = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(target=writer, args=(source_path, size, theirs_conn))
    process.start()
    assert conn.recv() == "ready"
    time.sleep(0.2)  # the server's page table for its file is filled ahead, as a spare's is
    start = time.perf_counter()
    conn.send("go")
    own = upload.buffer
    digests = IncomingDigests(memoryview(theirs) if theirs is not None else own)  # file and tensor xxh3
    cpu, at = time.process_time(), 0
    while at < size:
        end = conn.recv()
        if way == "server":
            upload.written(end)
        else:
            for block in range(at, end, BLOCK):
                stop = min(end, block + BLOCK)
                if way == "pread":
                    os.preadv(source, [own[block:stop]], block)
                digests.advance(stop)
        at = end
    if way == "server":
        upload.finish()
    else:
        digests.finish()
    done = time.perf_counter()
    cpu = time.process_time() - cpu
    writer_done = conn.recv()
    process.join()
    del digests  # its views of the mappings
    if theirs is not None:
        theirs.close()
    os.close(source)
    upload.discard()
    uploads.close()
    files.close()
    return writer_done - start, done - start, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs to put the files in")
    parser.add_argument("--ways", default="map,pread,server")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    ways = args.ways.split(",")
    results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="weightserver-bench-") as folder:
        for _ in range(args.count):  # interleaved: the machine's load falls on every way alike
            for way in ways:
                results[way].append(trial(way, size, Path(folder)))
    print(f"{format_size(size)}, {args.count} trials each, interleaved; medians in ms ({os.cpu_count()} CPUs)")
    for way in ways:
        wrote, done, cpu = (statistics.median(r[i] for r in results[way]) * 1e3 for i in range(3))
        print(
            f"{way:6s}  writer {wrote:7.1f}  server done {done:7.1f}  tail {done - wrote:6.1f}  server cpu {cpu:7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
