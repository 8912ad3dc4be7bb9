"""How long a delta fetch takes, from the call to the rebuilt version: a profile, not a bench row.

    .venv/bin/python -m bench.delta_fetch [--transport bulk] [--consume-base] [--size-mib 250] [--changed 0.02]

A bf16 model of 100 tensors is published twice, the second time with `--changed` of its elements
changed at random (as a bf16 cast of fp32 weights after an optimizer step). Each round fetches v1
whole, then times `fetch(version=2, base=<v1's FetchResult>)`. Prints the median and min of the
timed fetches (the first 2 of 8 are not counted), the bytes on the wire and whether a delta came.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from weightclient import WeightClient
from weightserver import ServerConfig, WeightServer

ROUNDS, WARMUP, TENSORS = 8, 2, 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="bulk", help="auto, shm, bulk or stream (default: bulk)")
    parser.add_argument("--consume-base", action="store_true", help="rebuild in the base's own bytes")
    parser.add_argument("--size-mib", type=float, default=250.0, help="the model's size (default: 250)")
    parser.add_argument("--changed", type=float, default=0.02, help="fraction of elements changed (default: 0.02)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    numel = int(args.size_mib * 2**20 / 2 / TENSORS)
    v1 = {f"t{i}": torch.randn(numel, generator=generator).to(torch.bfloat16) for i in range(TENSORS)}
    v2 = {}
    for name, tensor in v1.items():
        v2[name] = tensor.clone()
        index = torch.randint(0, numel, (int(numel * args.changed),), generator=generator)
        v2[name][index] += 1
    server = WeightServer(ServerConfig(host="127.0.0.1", port=0, keep=4)).start()
    try:
        with WeightClient(server.address) as trainer, WeightClient(server.address) as collector:
            trainer.publish(v1, model="m")
            trainer.publish(v2, model="m")
            seconds = []
            for _ in range(ROUNDS):
                held = collector.fetch("m", version=1, transport=args.transport)
                started = time.perf_counter()
                result = collector.fetch(
                    "m", version=2, base=held, transport=args.transport, consume_base=args.consume_base
                )
                seconds.append(time.perf_counter() - started)
                assert all(torch.equal(result.tensors[n], t) for n, t in v2.items()), "not bit-exact"
                del held
    finally:
        server.stop(grace=0)
    timed = [s * 1e3 for s in seconds[WARMUP:]]
    print(
        f"transport={args.transport} (used {result.stats.transport}) consume_base={args.consume_base} "
        f"delta={bool(result.base_version)} wire={result.stats.wire_bytes / 2**20:.1f} MiB: "
        f"median {statistics.median(timed):.1f} ms, min {min(timed):.1f} ms"
    )


if __name__ == "__main__":
    main()
