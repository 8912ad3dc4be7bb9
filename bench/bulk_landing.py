"""Where a bulk upload lands, and after how much idle: the same transfer, two ways of each.

    .venv/bin/python -m bench.bulk_landing [--size 16MiB] [--count 20] [--pause 1.0]

A profile, not a bench row. A spawned process sends a safetensors file with the client's own
`BulkTransport.upload` to a bare `BulkEndpoint` in this process (no gRPC, no store), which
receives it into
- `reused anonymous buffer`: one buffer, touched once and received into every time, as the
  `raw_tcp` baseline receives;
- `fresh shared-memory file`: a new upload file per transfer, its page table filled ahead
  (`SharedMemoryFiles.new_upload(populate=True)`), as the server receives a publish (the file
  then becomes the version's, so that same-host readers map it without a copy).
Each transfer follows `--pause` seconds of idle (1 s, as the publish rows; 0: back to back, as
`raw_tcp`). Prints the median and min of the sender's wall time per transfer (ticket to
acknowledgement) in ms. The README's breakdown of `publish_bulk` cites it.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import statistics
import tempfile
import time
from multiprocessing.queues import Queue
from pathlib import Path

from bench.baselines import IDLE_GAP_SECONDS
from bench.common import format_size, parse_size

SPAWN = multiprocessing.get_context("spawn")


def _file_of(size: int) -> bytes:
    import torch

    from weightclient import tensors as tensor_codec

    return b"".join(bytes(p) for p in tensor_codec.encode({"w": torch.randn(size // 4)}))


def _sender(port: int, size: int, tickets: Queue, seconds: Queue) -> None:
    from weightclient.transports.bulk import BulkTransport
    from weightserver.v1 import weights_pb2 as pb

    data = memoryview(_file_of(size))
    transport = BulkTransport("127.0.0.1")
    while (ticket := tickets.get()) is not None:
        payload = pb.Payload(byte_size=data.nbytes, bulk=pb.BulkTicket(port=port, ticket=ticket))
        start = time.perf_counter()
        transport.upload(payload, [data], deadline=None, progress=None)
        seconds.put(time.perf_counter() - start)


def profile(size: int, count: int, pause: float) -> dict[str, list[float]]:
    """{landing: [ms per transfer]} for `count` transfers of a `size`-byte model into each,
    each after `pause` seconds of idle."""
    from weightserver.transports.bulk import BulkEndpoint
    from weightserver.transports.shared_memory import SharedMemoryFiles

    nbytes = len(_file_of(size))
    endpoint = BulkEndpoint("127.0.0.1")
    tickets, seconds = SPAWN.Queue(), SPAWN.Queue()
    sender = SPAWN.Process(target=_sender, args=(endpoint.port, size, tickets, seconds), daemon=True)
    sender.start()
    reused = memoryview(mmap.mmap(-1, nbytes))
    reused[:] = bytes(nbytes)
    results: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
            files = SharedMemoryFiles(Path(folder))
            for landing in ("reused anonymous buffer", "fresh shared-memory file"):
                results[landing] = []
                for _ in range(count + 2):  # the first two warm the connection up
                    upload = None
                    if landing == "reused anonymous buffer":
                        buffer = reused
                    else:
                        upload = files.new_upload("model", nbytes, populate=True)
                        assert upload is not None, "no room in /dev/shm"
                        buffer = upload.buffer
                    time.sleep(pause)
                    tickets.put(endpoint.issue_upload(buffer, "profile", lambda n: None, lambda e: None))
                    results[landing].append(seconds.get(timeout=60) * 1e3)
                    if upload is not None:
                        upload.abort()
                results[landing] = results[landing][2:]
    finally:
        tickets.put(None)
        sender.join(30)
        endpoint.close()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("16MiB"))
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--pause", type=float, default=IDLE_GAP_SECONDS, help="idle seconds before each transfer")
    args = parser.parse_args(argv)
    print(f"bulk upload of {format_size(args.size)}, {args.count} times each, after {args.pause:g} s idle")
    for landing, times in profile(args.size, args.count, args.pause).items():
        print(f"{landing:<26} p50 {statistics.median(times):8.2f}  min {min(times):8.2f} ms")


if __name__ == "__main__":
    main()
