"""Where a bulk upload lands, and after how much idle: the same transfer, two ways of each.

    .venv/bin/python -m bench.bulk_landing [--size 16MiB] [--count 20] [--pause 1.0]

A profile, not a bench row. A spawned process sends a safetensors file with the client's own
`BulkTransport.upload` to a bare `BulkEndpoint` in this process (no gRPC, no store), which
receives it into
- `reused anonymous buffer`: one buffer, touched once and received into every time, as the
  `raw_tcp` baseline receives;
- `fresh shared-memory file`: a new upload file per transfer, its page table filled ahead
  (`SharedMemoryFiles.new_upload(populate=True)`), as the server receives a publish.
Each transfer follows `--pause` seconds of idle (0: back to back, as `raw_tcp`). Prints the
median and min of the sender's wall time per transfer (ticket to acknowledgement) in ms, and
the median's throughput. Every landed buffer is checked against the file (untimed).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path

import xxhash

from bench.baselines import IDLE_GAP_SECONDS
from bench.common import format_size, parse_size

SPAWN = multiprocessing.get_context("spawn")
LANDINGS = ("reused anonymous buffer", "fresh shared-memory file")
WARMUP = 2  # transfers per landing that warm the connection up, not reported


@dataclass(frozen=True)
class Transfer:
    """One timed upload: the sender's ms, the bytes the endpoint said arrived, and the xxh3-64
    of the buffer they landed in."""

    ms: float
    landed_bytes: int
    landed_xxh3: int


def file_of(size: int) -> bytes:
    """The file sent: one float32 tensor `w` = 0, 1, 2, ... of `size` bytes (never all zeros,
    so a transfer that lands nothing cannot match it)."""
    import torch

    from weightclient import tensors as tensor_codec

    return b"".join(bytes(p) for p in tensor_codec.encode({"w": torch.arange(size // 4, dtype=torch.float32)}))


def _sender(port: int, size: int, tickets: Queue, seconds: Queue) -> None:
    from weightclient.core.retry import NEVER
    from weightclient.transports.bulk import BulkTransport
    from weightserver.v1 import weights_pb2 as pb

    data = memoryview(file_of(size))
    transport = BulkTransport("127.0.0.1")
    while (ticket := tickets.get()) is not None:
        payload = pb.Payload(byte_size=data.nbytes, bulk=pb.BulkTicket(port=port, ticket=ticket))
        start = time.perf_counter()
        transport.upload(payload, [data], deadline=NEVER, progress=None)
        seconds.put(time.perf_counter() - start)


def profile(size: int, count: int, pause: float) -> dict[str, list[Transfer]]:
    """{landing: transfers} for `count` transfers of a `size`-byte model into each landing,
    each after `pause` seconds of idle."""
    from weightserver.transports.bulk import BulkEndpoint
    from weightserver.transports.shared_memory import SharedMemoryFiles

    nbytes = len(file_of(size))
    zeros = bytes(nbytes)
    endpoint = BulkEndpoint("127.0.0.1")
    tickets, seconds = SPAWN.Queue(), SPAWN.Queue()
    sender = SPAWN.Process(target=_sender, args=(endpoint.port, size, tickets, seconds), daemon=True)
    sender.start()
    reused = memoryview(mmap.mmap(-1, nbytes))
    results: dict[str, list[Transfer]] = {}
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
            files = SharedMemoryFiles(Path(folder))
            for landing in LANDINGS:
                results[landing] = []
                for _ in range(count + WARMUP):
                    idle_from = time.perf_counter()
                    upload = None
                    if landing == LANDINGS[0]:
                        buffer = reused
                        buffer[:] = zeros  # so that what is checked below landed in this transfer
                    else:
                        upload = files.new_upload("model", nbytes, populate=True)
                        assert upload is not None, "no room in /dev/shm"
                        buffer = upload.buffer
                    arrived: list[int] = [0]
                    failed: list[BaseException | None] = []
                    time.sleep(max(0.0, pause - (time.perf_counter() - idle_from)))
                    tickets.put(endpoint.issue(buffer, "profile", arrived=arrived.append, done=failed.append))
                    ms = seconds.get(timeout=60) * 1e3
                    if failed != [None]:
                        raise RuntimeError(f"the upload into the {landing} failed: {failed}")
                    results[landing].append(Transfer(ms, max(arrived), xxhash.xxh3_64_intdigest(buffer)))
                    if upload is not None:
                        upload.abort()
                results[landing] = results[landing][WARMUP:]
    finally:
        tickets.put(None)
        sender.join(30)
        endpoint.close()
    return results


def main(argv: list[str] | None = None) -> dict[str, list[Transfer]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("16MiB"))
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--pause", type=float, default=IDLE_GAP_SECONDS, help="idle seconds before each transfer")
    args = parser.parse_args(argv)
    print(f"bulk upload of {format_size(args.size)}, {args.count} times each, after {args.pause:g} s idle")
    results = profile(args.size, args.count, args.pause)
    for landing, transfers in results.items():
        times = [t.ms for t in transfers]
        p50 = statistics.median(times)
        gbps = transfers[0].landed_bytes / p50 / 1e6
        print(f"{landing:<26} p50 {p50:8.2f}  min {min(times):8.2f} ms  {gbps:6.2f} GB/s")
    return results


if __name__ == "__main__":
    main()
