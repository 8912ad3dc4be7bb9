"""How many idle watchers one server holds, and what they cost.

Opens N Watch streams at once (grpc.aio, spread over several connections, as when every
watcher resubscribes after a restart) against a server in its own process, measures the
server's RSS before and after, then publishes one version and times from the publish call
until every watcher has been told.

    .venv/bin/python bench/idle_watchers.py --watchers 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.common import rss_bytes
from weightclient.core.service_client import WeightServiceClient
from weightserver.process import ServerProcess
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
STREAMS_PER_CONNECTION = 250  # well below the server's --max-concurrent-streams (1024)


@dataclass
class IdleWatchersResult:
    watchers: int
    connections: int
    rss_before_bytes: int
    rss_after_bytes: int
    bytes_per_watcher: float
    subscribe_seconds: float
    notify_all_seconds: float  # publish called -> the last watcher got the event
    notified: int


async def _measure(address: str, pid: int, watchers: int) -> IdleWatchersResult:
    connections = max(1, -(-watchers // STREAMS_PER_CONNECTION))
    # A local subchannel pool per channel: otherwise gRPC shares one TCP connection between
    # channels to the same address, and that connection's stream limit applies to all.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    stubs = [pb_grpc.WeightServiceStub(c) for c in channels]
    with WeightServiceClient(address) as client:
        first = client.publish_bytes(MODEL, _tiny_file(0.0)).version
        rss_before = rss_bytes(pid)
        started = time.perf_counter()
        # All at once, as after a server restart when every watcher resubscribes.
        calls = [stubs[i % connections].Watch(pb.WatchRequest(model=MODEL, since=first)) for i in range(watchers)]
        await asyncio.gather(*(call.wait_for_connection() for call in calls))
        subscribe_seconds = time.perf_counter() - started
        await asyncio.sleep(1.0)  # let the server settle before sampling its memory
        rss_after = rss_bytes(pid)

        async def first_event(call) -> float:
            await call.read()
            return time.perf_counter()

        waiting = [asyncio.ensure_future(first_event(call)) for call in calls]
        await asyncio.sleep(0.2)
        published = time.perf_counter()
        version = await asyncio.to_thread(lambda: client.publish_bytes(MODEL, _tiny_file(1.0)).version)
        times = await asyncio.gather(*waiting)
        assert version == first + 1
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close()
    return IdleWatchersResult(
        watchers=watchers,
        connections=connections,
        rss_before_bytes=rss_before,
        rss_after_bytes=rss_after,
        bytes_per_watcher=(rss_after - rss_before) / watchers,
        subscribe_seconds=subscribe_seconds,
        notify_all_seconds=max(times) - published,
        notified=len(times),
    )


def _tiny_file(value: float) -> bytes:
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + struct.pack("<f", value)


def measure(watchers: int) -> IdleWatchersResult:
    """Start a server process, hold `watchers` idle watches on it, publish once."""
    with ServerProcess() as server:
        return asyncio.run(_measure(server.address, server.process.pid, watchers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, default=5000, help="idle Watch streams to open (default: 5000)")
    args = parser.parse_args(argv)
    result = measure(args.watchers)
    print(
        f"{result.watchers} idle watchers over {result.connections} connections: server RSS "
        f"{result.rss_before_bytes / 1e6:.0f} MB -> {result.rss_after_bytes / 1e6:.0f} MB "
        f"({result.bytes_per_watcher / 1e3:.1f} kB per watcher); subscribed in {result.subscribe_seconds:.2f}s; "
        f"from the publish call to the last of {result.notified} watchers notified: "
        f"{result.notify_all_seconds * 1e3:.0f} ms"
    )
    return 0 if result.notified == result.watchers else 1


if __name__ == "__main__":
    sys.exit(main())
