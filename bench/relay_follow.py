"""`relay_follow` (issue 28): a relay receives a 256 MiB version from its primary, against raw
loopback TCP of the same bytes measured in the same run (target <= 1.3x).

Separate processes (`ServerProcess`). Each repeat, the primary holds a new version and a fresh
relay (no data dir, so it fetches the version whole) follows it; the time is the relay's own
`duration_ms` for that version (its log's `relay ... payload=whole` line): the fetch, the store's
checks of size, xxh3 and sha256, and the commit. The same on three primaries, so that the relay
negotiates what a collector would: shared memory on the same host (`relay_follow`), bulk TCP
(`--no-shm`: `relay_follow_bulk`) and the gRPC stream (`--no-shm --no-bulk`:
`relay_follow_stream`, the only way a relay fetched before issue 28).
"""

from __future__ import annotations

import re
import time

from bench.baselines import raw_tcp
from bench.common import WARMUP_ROUNDS, MiB, Row, log
from weightclient.core.service_client import WeightServiceClient
from weightserver.process import ServerProcess

ROW = "relay_follow"
NAMES = (ROW, "relay_follow_bulk", "relay_follow_stream")
SIZE = 256 * MiB
TARGET = 1.3  # x raw TCP's median time
MODEL = "relay-follow"
PRIMARIES = {ROW: (), "relay_follow_bulk": ("--no-shm",), "relay_follow_stream": ("--no-shm", "--no-bulk")}
_LINE = re.compile(rf"relay model={MODEL} version=(\d+) bytes=(\d+) payload=whole duration_ms=([\d.]+)")


def _file(step: int) -> bytes:
    """A safetensors file of one uint8 tensor of SIZE bytes, every byte `step`."""
    header = f'{{"w":{{"dtype":"U8","shape":[{SIZE}],"data_offsets":[0,{SIZE}]}}}}'.encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes([step % 251]) * SIZE


def _relayed_ms(primary: ServerProcess, version: int) -> float:
    """Start a relay of `primary`, wait for its log line of `version`, and stop it."""
    with ServerProcess("--upstream", primary.address, "--upstream-poll", "0.1", "--no-shm") as relay:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = [m for m in _LINE.finditer(relay.log()) if int(m.group(1)) == version]
            if found:
                return float(found[0].group(3))
            time.sleep(0.05)
    raise TimeoutError(f"the relay did not log v{version} within 120 s")


def relay_follow(repeats: int) -> list[Row]:
    """The three rows (see the module docstring), each against raw TCP's median."""
    base = raw_tcp(SIZE, repeats)
    base_ms = sorted(base.extra["seconds"])[len(base.extra["seconds"]) // 2] * 1e3
    rows = [base]
    for name, args in PRIMARIES.items():
        samples = []
        with ServerProcess(*args) as primary, WeightServiceClient(primary.address) as trainer:
            for step in range(repeats + WARMUP_ROUNDS):
                version = trainer.publish_bytes(MODEL, _file(step)).version
                milliseconds = _relayed_ms(primary, version)
                log(f"{name}: v{version} relayed in {milliseconds:.1f} ms")
                if step >= WARMUP_ROUNDS:
                    samples.append(milliseconds)
        row = Row(name, SIZE, "ms", samples, baseline="raw_tcp", baseline_value=base_ms)
        median = sorted(samples)[len(samples) // 2]
        rows.append(row.judge(median / base_ms, "<=", TARGET, f"ratio <= {TARGET:g}x raw TCP"))
    return rows
