"""Row `sharded_fetch` (issue 32): 4 tensor-parallel ranks, each a collector process of its own,
fetch their quarter of a model at once (`select=tensor_parallel(rank, 4, plan)`), against one of the
same processes fetching the whole model alone.

Judged: the bytes the 4 ranks received together over the model's (<= 1.05x; 4x when every rank
fetches it whole), and the slowest rank's time in a round over the whole fetch's (<= 0.35x). The
model: 8 float32 matrices of `size` bytes together, half split along dim 0 (column-parallel), half
along dim 1 (row-parallel), and a small norm that every rank gets whole.
"""

from __future__ import annotations

import os
import statistics

import torch

from bench.common import Row, format_size, log
from bench.pool import FetchPool
from bench.rows import Context, compare, transport_kwargs

ROW = "sharded_fetch"
RANKS = 4
MATRICES = 8
PLAN = {"col.*": 0, "row.*": 1}


def sharded_model(size: int) -> dict[str, torch.Tensor]:
    """MATRICES square-ish float32 matrices of `size` bytes in all, and a norm."""
    side = max(RANKS, int((size // 4 // MATRICES) ** 0.5))
    weights = {f"{'col' if i % 2 else 'row'}.{i}": torch.full((side, side), float(i)) for i in range(MATRICES)}
    return {**weights, "norm": torch.ones(side)}


def sharded_fetch(ctx: Context, size: int) -> list[Row]:
    from weightclient import tensor_parallel

    model = f"sharded-{format_size(size)}"
    version = ctx.client.publish(sharded_model(size), model=model)
    whole_bytes = ctx.client.describe(model, version).byte_size
    each = [{"select": tensor_parallel(rank, RANKS, PLAN)} for rank in range(RANKS)]
    log(f"{ROW}: starting {RANKS} rank processes (WeightClient each)")
    kwargs = transport_kwargs(ctx.transport)
    with FetchPool(RANKS, ctx.address, use_torch=True, warm_model=model, fetch_kwargs=kwargs) as pool:
        whole, alone, slowest, received = [], [], [], []
        for i in range(ctx.repeats + 1):  # the first round warms up (and builds each selection once)
            _, start, end, _, transport = pool.fetch_one(0, model, version)
            _, alone_start, alone_end, *_ = pool.fetch_one(1, model, version, **each[1])
            results = pool.fetch_all(model, version, each=each)
            if i:
                whole.append((end - start) / 1e9)
                alone.append((alone_end - alone_start) / 1e9)
                slowest.append(max(r[2] - r[1] for r in results) / 1e9)
                received.append(sum(r[3] for r in results))
    ctx.drop(model)
    used = "/".join(sorted({transport, *(r[4] for r in results)}))
    base = Row("whole_fetch", size, "ms", [s * 1e3 for s in whole], kind="baseline")
    base.note = f"one rank process alone fetches the whole model ({whole_bytes} bytes); via {used}"
    volume = Row(f"{ROW}_bytes", size, "x", [r / whole_bytes for r in received])
    volume.note = f"bytes the {RANKS} ranks received together / the model's bytes"
    volume.extra = {"received_bytes": received, "model_bytes": whole_bytes}
    timed = Row(ROW, size, "ms", [s * 1e3 for s in slowest])
    timed.note = f"the slowest of {RANKS} ranks fetching their quarter at once / the whole fetch; via {used}"
    single = Row(f"{ROW}_alone", size, "ms", [s * 1e3 for s in alone])
    single.note = (
        f"one rank fetching its quarter while the others wait (ranks that share no CPU, {os.cpu_count()} here)"
    )
    compare(single, base, "<=", 0.35).passed, single.target = None, "none (shows the cause)"
    judged = [volume.judge(statistics.median(volume.samples), "<=", 1.05), compare(timed, base, "<=", 0.35)]
    return [base, *judged, single]


SIZED_ROWS = {ROW: sharded_fetch}
