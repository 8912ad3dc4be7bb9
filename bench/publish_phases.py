"""Where a publish's time goes: the server's own per-phase timing of each `publish()`.

    .venv/bin/python -m bench.publish_phases [--size 16MiB] [--transport shm] [--count 20] [--gap 1.0]

A profile, not a bench row. The server logs each publish with the time it spent receiving
(until the commit message), verifying (until the digests of the bytes were in) and committing
(`receive_ms`, `verify_ms`, `commit_ms` beside `duration_ms`); this tool reads those log records
and times `publish()` on the client around them, so nothing private is wrapped. Each publish
follows `--gap` seconds of idle, as the `publish_*` rows do; the first WARMUP are not reported.
Prints the p50, min and max of each phase in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from bench.common import format_size, parse_size
from bench.models import FlatPolicy
from weightclient import WeightClient
from weightserver.server import WeightServer

WARMUP = 5
SERVER_LOGGER = "weightserver.service.servicer"
# (field of the server's publish record, label), in the order printed.
SERVER_PHASES = [
    ("receive_ms", "server: receive, until the commit message"),
    ("verify_ms", "server: verify, until the digests are in"),
    ("commit_ms", "server: the store's commit"),
    ("duration_ms", "server: the Publish call"),
]
TOTAL = "client: publish() until committed"


class PublishRecords(logging.Handler):
    """The server's `publish` log records, as they are logged in this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "publish":
            self.records.append(record)


@contextlib.contextmanager
def publish_records() -> Iterator[PublishRecords]:
    """Collect the publish records of servers in this process while the block runs."""
    logger, handler = logging.getLogger(SERVER_LOGGER), PublishRecords()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def profile(size: int, transport: str, count: int, gap: float) -> dict[str, list[float]]:
    """{phase: durations in ms} of `count` timed publishes of a `size`-byte model."""
    phases: dict[str, list[float]] = defaultdict(list)
    with publish_records() as logged, WeightServer() as server, WeightClient(server.address) as client:
        weights = FlatPolicy(size, 4, fill=3.0)
        for i in range(WARMUP + count):
            with torch.no_grad():
                for param in weights.parameters():
                    param[0] = i  # every version differs
            time.sleep(gap)
            start = time.perf_counter()
            version = client.publish(weights, model="phases", transport=transport)
            phases[TOTAL].append((time.perf_counter() - start) * 1e3)
            (record,) = [r for r in logged.records if getattr(r, "version", None) == version]
            for field, label in SERVER_PHASES:
                phases[label].append(getattr(record, field))
    return {label: times[WARMUP:] for label, times in phases.items()}


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
