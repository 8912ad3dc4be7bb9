"""The 4 GiB round trip (issue 15), report only: a model of ONE float32 tensor of 4 GiB (the
file just over 2^32 bytes) published and then fetched back per transport, on a fresh server.

    .venv/bin/python bench/run.py --large --only roundtrip_4gib [--repeats 2]

For each transport: `publish(module, transport=...)` until committed (over the stream where
publish has no transport= yet), then `fetch(version=..., transport=..., place=...)` straight
into the live module's parameter, as a collector fetches. Both are timed and given in GB/s of
the file's bytes. Untimed around them: the older version is deleted before each publish (the
server then holds one 4 GiB version, the client one module: about 8.5 GiB between them), the
parameter is overwritten before each fetch, and the fetched tensor's xxh3 must equal the
published one's (a wrong byte makes the row an error). At most LARGE_REPEATS rounds per
transport: one round is about half a minute.
"""

from __future__ import annotations

import inspect
import statistics
import time

import torch
import xxhash

from bench.common import GiB, Row, gbps, hwm_bytes, log, not_available
from weightclient import WeightClient
from weightserver.process import ServerProcess

ROW = "roundtrip_4gib"
TENSOR_BYTES = 4 * GiB
TRANSPORTS = ("stream", "bulk", "shm")
LARGE_REPEATS = 2
MODEL = "roundtrip-4gib"


def _digest(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(tensor.numpy()).cast("B"))


def roundtrip_4gib(repeats: int) -> list[Row]:
    """Rows `roundtrip_4gib_<transport>_publish` and `..._fetch` (GB/s, no target)."""
    publish_has_transport = "transport" in inspect.signature(WeightClient.publish).parameters
    repeats = min(repeats, LARGE_REPEATS)
    rows: list[Row] = []
    with ServerProcess("--keep", "1") as server, WeightClient(server.address, timeout=120) as client:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.empty(TENSOR_BYTES // 4), requires_grad=False)
        weight = module.weight.data
        torch.arange(weight.numel(), dtype=torch.int32, out=weight.view(torch.int32))  # every word distinct
        expected = _digest(weight)
        previous = 0
        for transport in TRANSPORTS:
            publish_kwargs = {"transport": transport} if publish_has_transport else {}
            publish_s, fetch_s, used, direct = [], [], [], []
            file_bytes = 0
            for _ in range(repeats):
                if previous:
                    client.delete(MODEL, previous)
                torch.arange(weight.numel(), dtype=torch.int32, out=weight.view(torch.int32))
                start = time.perf_counter()
                version = client.publish(module, model=MODEL, **publish_kwargs)
                publish_s.append(time.perf_counter() - start)
                previous = version
                info = client.describe(MODEL, version)
                file_bytes = info.byte_size
                if info.tensors[0].xxh3 != expected:
                    raise AssertionError(f"the server's copy of v{version} differs from what was published")
                weight.view(torch.int32).fill_(-1)
                start = time.perf_counter()
                result = client.fetch(MODEL, version=version, transport=transport, place=lambda _: {"weight": weight})
                fetch_s.append(time.perf_counter() - start)
                used.append(result.stats.transport)
                direct.append(result.stats.direct)
                if not result.placed or _digest(weight) != expected:
                    raise AssertionError(f"fetch over {transport} did not bring v{version} back bit-exact")
                log(f"{ROW} {transport}: publish {publish_s[-1]:.1f}s, fetch {fetch_s[-1]:.1f}s")
            client.flush(30)
            carried = "/".join(sorted(set(used)))
            if publish_has_transport or transport == "stream":
                row = Row(f"{ROW}_{transport}_publish", TENSOR_BYTES, "GB/s", [gbps(file_bytes, s) for s in publish_s])
                row.note = (
                    f"publish(transport={transport if publish_has_transport else 'n/a'}) of one {file_bytes}-byte "
                    f"file (one 4 GiB float32 tensor) until committed: median {statistics.median(publish_s):.1f} s"
                )
                row.target, row.extra = "none (report only)", {"seconds": publish_s, "file_bytes": file_bytes}
                rows.append(row)
            else:
                rows.append(
                    not_available(
                        f"{ROW}_{transport}_publish",
                        TENSOR_BYTES,
                        "GB/s",
                        "none (report only)",
                        "publish() has no transport=: publishes go over the stream (the stream row)",
                    )
                )
            row = Row(f"{ROW}_{transport}_fetch", TENSOR_BYTES, "GB/s", [gbps(file_bytes, s) for s in fetch_s])
            row.note = (
                f"fetch(transport={transport}, place=live module) of the same file, verified by xxh3: median "
                f"{statistics.median(fetch_s):.1f} s; carried by {carried}"
                + (f"; read without a call in {sum(direct)}/{len(direct)}" if any(direct) else "")
                + ("" if carried == transport else f"; FELL BACK from {transport}")
            )
            row.target = "none (report only)"
            row.extra = {"seconds": fetch_s, "file_bytes": file_bytes, "transports": used, "direct": direct}
            rows.append(row)
        peaks = {"server_vmhwm_bytes": hwm_bytes(server.process.pid), "client_vmhwm_bytes": hwm_bytes()}
    for row in rows:
        row.extra.update(peaks)
    rows[-1].note += (
        f"; peak RSS: server {peaks['server_vmhwm_bytes'] / GiB:.1f} GiB, this process "
        f"{peaks['client_vmhwm_bytes'] / GiB:.1f} GiB"
    )
    return rows
