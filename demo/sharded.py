"""Tensor-parallel ranks pulling only their shard: `python -m demo.sharded [--world 4] [--config tiny]`.

A trainer publishes a `transformers` Llama built from a config (random init, nothing
downloaded) to a server of its own; `--world` rank processes each fetch their shard with
`tensor_parallel(rank, world, LLAMA_PLAN)` (q/k/v/gate/up and the embeddings split along dim
0, o/down along dim 1, norms whole) into a policy holding only that shard, for `--versions`
versions. The trainer then checks that the ranks' shards, concatenated along their dims, are
the full tensors bit for bit, and prints the bytes each rank received against the model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time

import torch

from bench.traces import LM_CONFIGS, lm_trace
from weightclient import LLAMA_PLAN, WeightClient, tensor_parallel
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightserver import ServerConfig, WeightServer

MODEL = "llm"


def rank_main(address: str, rank: int, world: int, versions: int, out: multiprocessing.Queue) -> None:
    """One rank: an updater with its selection keeps a dict of only its shards current."""
    select = tensor_parallel(rank, world, LLAMA_PLAN)
    with WeightClient(address) as client:
        first = client.fetch(MODEL, version=1, select=select)
        policy = {name: tensor.clone() for name, tensor in first.tensors.items()}  # the rank's own memory
        updater = GrpcLocalWeightUpdater(client, model=MODEL, policy=policy, select=select, transport="bulk")
        for version in range(1, versions + 1):  # the trainer publishes the next once every rank has this one
            deadline = time.monotonic() + 120
            while updater.version != version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: v{version} not applied in 120 s ({updater.status})")
                updater()
                time.sleep(0.01)
            shard = {name: (raw(t), tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in policy.items()}
            out.put((rank, version, shard, updater.last_fetch.wire_bytes))  # bytes: no tensor crosses the pipe


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _tensors(shard: dict[str, tuple[bytes, tuple[int, ...], str]]) -> dict[str, torch.Tensor]:
    return {
        name: torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
        for name, (data, shape, dtype) in shard.items()
    }


def dims(name: str) -> int | None:
    """The dimension `LLAMA_PLAN` splits `name` along (None: whole)."""
    from fnmatch import fnmatchcase

    return next((dim for pattern, dim in LLAMA_PLAN.items() if fnmatchcase(name, pattern)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="tensor-parallel ranks (default 4)")
    parser.add_argument("--config", default="tiny", choices=sorted(LM_CONFIGS), help="model size (default tiny)")
    parser.add_argument("--versions", type=int, default=3, help="versions published (default 3)")
    args = parser.parse_args(argv)

    server = WeightServer(ServerConfig(host="127.0.0.1", port=0)).start()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [
        context.Process(target=rank_main, args=(server.address, r, args.world, args.versions, out), daemon=True)
        for r in range(args.world)
    ]
    try:
        with WeightClient(server.address) as trainer:
            published: list[dict[str, torch.Tensor]] = []
            shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
            wire: dict[tuple[int, int], int] = {}
            for weights in lm_trace(args.versions, config=args.config):
                published.append(weights)
                trainer.publish(weights, model=MODEL)
                if len(published) == 1:
                    for process in ranks:
                        process.start()
                for _ in range(args.world):  # every rank holds this version before the next comes
                    rank, version, shard, received = out.get(timeout=180)
                    shards[(rank, version)], wire[(rank, version)] = _tensors(shard), received
        full = sum(t.numel() * t.element_size() for t in published[0].values())
        for version, weights in enumerate(published, start=1):
            for name, tensor in weights.items():
                parts = [shards[(rank, version)][name] for rank in range(args.world)]
                dim = dims(name)
                whole = torch.cat(parts, dim=dim) if dim is not None else parts[0]
                if raw(whole) != raw(tensor):
                    print(f"v{version} {name}: the shards do not make the tensor", file=sys.stderr)
                    return 1
            shares = ", ".join(f"{wire[(r, version)] / full:.2f}" for r in range(args.world))
            print(
                f"v{version}: the {args.world} ranks' shards make every tensor bit for bit; "
                f"bytes per rank / model: {shares}"
            )
        return 0
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        server.stop(grace=0)


if __name__ == "__main__":
    sys.exit(main())
