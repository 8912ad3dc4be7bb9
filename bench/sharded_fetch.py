"""Row `sharded_fetch` (issue 32): 4 tensor-parallel ranks, each a collector process of its own,
fetch their quarter of a model at once (`select=tensor_parallel(rank, 4, plan)`), against the same
4 ranks fetching the whole model at once, as every rank did before selections (the same topology).

Judged: the bytes the 4 ranks received together over the model's (<= 1.05x; 4x when every rank
fetches it whole), and the slowest rank's time in a round over the slowest whole fetch's (<= 0.35x).
Reported beside them: one rank alone fetching the whole model (`whole_fetch_alone`), and the quarter
fetches against it; on a host with fewer cores than ranks, the ranks share the CPU and that ratio
shows it. The model: 8 float32 matrices of `size` bytes together, half split along dim 0
(column-parallel), half along dim 1 (row-parallel), and a small norm that every rank gets whole.
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
        whole, whole_alone, alone, slowest, received = [], [], [], [], []
        for i in range(ctx.repeats + 1):  # the first round warms up (and builds each selection once)
            _, start, end, _, transport = pool.fetch_one(0, model, version)
            _, alone_start, alone_end, *_ = pool.fetch_one(1, model, version, **each[1])
            everyone = pool.fetch_all(model, version)
            results = pool.fetch_all(model, version, each=each)
            if i:
                whole_alone.append((end - start) / 1e9)
                whole.append(max(r[2] - r[1] for r in everyone) / 1e9)
                alone.append((alone_end - alone_start) / 1e9)
                slowest.append(max(r[2] - r[1] for r in results) / 1e9)
                received.append(sum(r[3] for r in results))
    ctx.drop(model)
    used = "/".join(sorted({transport, *(r[4] for r in results)}))
    base = Row("whole_fetch", size, "ms", [s * 1e3 for s in whole], kind="baseline")
    base.note = f"the slowest of {RANKS} ranks each fetching the whole model ({whole_bytes} bytes) at once; via {used}"
    lone = Row("whole_fetch_alone", size, "ms", [s * 1e3 for s in whole_alone], kind="baseline")
    lone.note = "one rank process alone fetches the whole model"
    volume = Row(f"{ROW}_bytes", size, "x", [r / whole_bytes for r in received])
    volume.note = f"bytes the {RANKS} ranks received together / the model's bytes"
    volume.extra = {"received_bytes": received, "model_bytes": whole_bytes}
    timed = Row(ROW, size, "ms", [s * 1e3 for s in slowest])
    timed.note = f"the slowest of {RANKS} ranks fetching their quarter at once / {RANKS} fetching the whole; via {used}"
    cores = f"{RANKS} ranks and the server share {os.cpu_count()} cores here"
    against_lone = Row(f"{ROW}_vs_alone", size, "ms", list(timed.samples))
    against_lone.note = f"the same quarter fetches / one whole fetch alone ({cores})"
    single = Row(f"{ROW}_alone", size, "ms", [s * 1e3 for s in alone])
    single.note = "one rank fetching its quarter while the others wait / one whole fetch alone"
    for reported in (against_lone, single):
        compare(reported, lone, "<=", 0.35).passed, reported.target = None, "none (reported)"
    judged = [volume.judge(statistics.median(volume.samples), "<=", 1.05), compare(timed, base, "<=", 0.35)]
    return [base, lone, *judged, against_lone, single]


SIZED_ROWS = {ROW: sharded_fetch}
