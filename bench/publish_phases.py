"""Where a publish's time goes: the phases of `publish()` over one transport, each timed.

    .venv/bin/python -m bench.publish_phases [--size 16MiB] [--transport shm] [--count 20] [--gap 1.0]

A profile, not a bench row: the server runs in this process (`WeightServer`) so that its
phases can be timed, and this tool wraps functions of both sides (private ones included) with
a timer. Each publish follows `--gap` seconds of idle, as the `publish_*` rows do; the first
`WARMUP` are not reported. Prints the p50, min and max of each phase in ms. The README's
breakdowns of `publish_shm` and `publish_bulk` were measured with it. A shared-memory publish
opens its Publish call before writing (the server hashes what it is told is written), so its
call spans the copy: its last phase is the commit's.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

import weightserver.publish.staged_uploads as staged_uploads
import weightserver.service.servicer as service
import weightserver.storage.store as store
from bench.common import format_size, parse_size
from bench.models import FlatPolicy
from weightclient import WeightClient
from weightclient.transports import bulk, shared_memory, stream
from weightserver.server import WeightServer

WARMUP = 5

# (owner, attribute, label): what is timed, in the order printed.
PHASES: list[tuple[object, str, str]] = [
    (shared_memory.SharedMemoryTransport, "upload", "client: copy and hash into the shm upload"),
    (bulk.BulkTransport, "upload", "client: send the bulk upload, hashing"),
    (stream.StreamTransport, "send", "client: the Publish call"),
    (stream.OpenPublish, "commit", "client: the commit, until the reply (written in place)"),
    (service.WeightServicer, "_receive_and_commit", "server: Publish, receive to commit"),
    (service._IncomingModel, "as_upload", "server:   the upload's digests, awaited"),
    (staged_uploads.StagedUpload, "finish", "server:     its pass over the bytes"),
    (store.VersionStore, "publish_group", "server:   the store's commit"),
    (service._IncomingModel, "_adopt", "server:     adopting the file, its header"),
]


def _timed(owner: object, name: str, label: str, into: dict[str, list[float]]) -> None:
    """Replace `owner.name` with a wrapper adding each call's duration in ms to `into[label]`."""
    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                into[label].append((time.perf_counter() - start) * 1e3)

        setattr(owner, name, timed_async)
        return

    @functools.wraps(fn)
    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[label].append((time.perf_counter() - start) * 1e3)

    setattr(owner, name, timed)


def profile(size: int, transport: str, count: int, gap: float) -> dict[str, list[float]]:
    """{phase: durations in ms} of `count` timed publishes of a `size`-byte model."""
    phases: dict[str, list[float]] = defaultdict(list)
    originals: list[tuple[object, str, Callable[..., object]]] = []
    for owner, name, label in PHASES:
        originals.append((owner, name, getattr(owner, name)))
        _timed(owner, name, label, phases)
    try:
        totals = []
        with WeightServer() as server, WeightClient(server.address) as client:
            weights = FlatPolicy(size, 4, fill=3.0)
            for i in range(WARMUP + count):
                with torch.no_grad():
                    for param in weights.parameters():
                        param[0] = i  # every version differs
                time.sleep(gap)
                start = time.perf_counter()
                client.publish(weights, model="phases", transport=transport)
                totals.append((time.perf_counter() - start) * 1e3)
        phases["publish() until committed"] = totals
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    order = [label for _, _, label in PHASES] + ["publish() until committed"]
    return {label: phases[label][WARMUP:] for label in order if len(phases[label]) > WARMUP}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("16MiB"), help="model size (default 16MiB)")
    parser.add_argument("--transport", choices=("shm", "bulk", "stream"), default="shm")
    parser.add_argument("--count", type=int, default=20, help="timed publishes (default 20)")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds idle before each publish (default 1.0)")
    args = parser.parse_args(argv)
    print(f"publish of {format_size(args.size)} over {args.transport}, {args.count} times, {args.gap:g} s apart")
    for label, times in profile(args.size, args.transport, args.count, args.gap).items():
        print(f"{label:45s} p50 {statistics.median(times):8.2f}  min {min(times):8.2f}  max {max(times):8.2f} ms")


if __name__ == "__main__":
    main()
