"""Baseline: TorchRL's own multiprocess weight sync, measured in a subprocess of its own.

    python -m bench.torchrl_sync --sizes 16777216,268435456 --repeats 5 [--idle 1]   (prints JSON)

For each size N: a MultiSyncCollector with 2 worker processes on PendulumEnv and a policy
whose parameters total ~N bytes (a TensorDictModule around Linear(2, h) -> Linear(h, 1),
h = N / 16, i.e. 4h + 1 float32), with torchrl's default weight sync scheme for it
(SharedMemWeightSyncScheme: both workers map ONE shared-memory copy of the weights).

Timed: `collector.update_policy_weights_(TensorDict.from_module(new_policy))`, which copies
the new weights into the shared buffer (`update_`), tells each worker's receiver thread to
apply them, and, the scheme being synchronous, waits for both workers' acknowledgements.
The collector is not iterated (no rollouts run). Each repeat first changes every parameter
of `new_policy` (`add_(1)`, untimed), so each update carries new values. Collector
construction and shutdown are not timed.

Two series with the same collector: `hot_seconds`, each update right after the last; and,
with `--idle S`, `seconds`, each update S seconds of idle after the change, as the freshness
rows publish (without `--idle`, `seconds` is the back-to-back series). On a VM a second of
idle can make the same update ten times slower (16 MiB: 4.5 ms back to back, 46 ms after 1 s
idle, measured on the development machine): a row and its baseline get the same idle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

warnings.filterwarnings("ignore", r"Creating \w+ which inherits from WeightUpdaterBase", DeprecationWarning)

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402


class BigActor(torch.nn.Module):
    """Pendulum actor with a hidden layer wide enough to hold ~N bytes of parameters."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(2, hidden)
        self.l2 = torch.nn.Linear(hidden, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.tanh(self.l2(torch.tanh(self.l1(torch.stack([th, thdot], -1)))))


def make_env():
    from torchrl.envs import PendulumEnv

    return PendulumEnv()


def make_policy(nbytes: int) -> TensorDictModule:
    return TensorDictModule(BigActor(max(1, nbytes // 16)), in_keys=["th", "thdot"], out_keys=["action"])


def log(message: str) -> None:
    print(f"[torchrl_sync] {message}", file=sys.stderr, flush=True)


def measure(nbytes: int, repeats: int, idle: float = 0.0) -> dict:
    from torchrl.collectors import MultiSyncCollector

    started = time.perf_counter()
    collector = MultiSyncCollector(
        [make_env, make_env],
        make_policy(nbytes),
        frames_per_batch=8,
        total_frames=-1,
        auto_register_policy_transforms=False,
    )
    built = time.perf_counter() - started
    try:
        schemes = getattr(collector, "_weight_sync_schemes", None) or {}
        scheme = type(schemes.get("policy")).__name__ if schemes else "unknown"
        new_policy = make_policy(nbytes)
        param_bytes = sum(p.numel() * p.element_size() for p in new_policy.parameters())

        def series(idle: float) -> list[float]:
            seconds = []
            for i in range(repeats + 1):  # the first update is a warm-up
                with torch.no_grad():
                    for param in new_policy.parameters():
                        param.add_(1.0)
                time.sleep(idle)
                start = time.perf_counter()
                collector.update_policy_weights_(TensorDict.from_module(new_policy))
                elapsed = time.perf_counter() - start
                if i:
                    seconds.append(elapsed)
            return seconds

        hot = series(0.0)
        seconds = series(idle) if idle else hot
        shared = schemes["policy"].shared_transport.unique_weights[0] if schemes else None
        verified = shared is not None and all(
            torch.equal(a, b)
            for a, b in zip(
                shared.flatten_keys(".").values(),
                TensorDict.from_module(new_policy).flatten_keys(".").values(),
                strict=True,
            )
        )
    finally:
        collector.shutdown()
    after = f", {sorted(seconds)[len(seconds) // 2] * 1e3:.1f} ms after {idle:g} s idle" if idle else ""
    log(f"{nbytes} bytes: built in {built:.1f}s, median {sorted(hot)[len(hot) // 2] * 1e3:.1f} ms back to back{after}")
    return {
        "nbytes": nbytes,
        "param_bytes": param_bytes,
        "seconds": seconds,
        "hot_seconds": hot,
        "idle_seconds": idle,
        "scheme": scheme,
        "workers": 2,
        "construct_seconds": built,
        "verified_shared_buffer": verified,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of idle before each update of a second series")
    args = parser.parse_args()
    results = [measure(int(size), args.repeats, args.idle) for size in args.sizes.split(",")]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
