"""Round trip through a standalone weight server: publish, watch, fetch, restart.

    python -m demo.roundtrip [--versions 3]

Starts `weightserver serve` in a child process with a data directory, then plays a trainer
(publishes a few versions of a small policy) and a collector (watches, fetches latest, exact
and "only if newer" versions, loads them into its own copy of the policy), restarts the
server and checks every retained version comes back with the same digest.
"""

from __future__ import annotations

import argparse
import tempfile
import threading

import torch

from weightclient import WeightClient
from weightserver.process import ServerProcess


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=3, help="versions to publish (default: %(default)s)")
    parser.add_argument("--model", default="policy", help="model name (default: %(default)s)")
    args = parser.parse_args()

    torch.manual_seed(0)
    data_dir = tempfile.mkdtemp(prefix="weightserver-demo-")
    server = ServerProcess("--data-dir", data_dir, "--keep", str(max(3, args.versions)))
    with server:
        print(f"server    weightserver serve on {server.address}, data dir {data_dir}")
        trainer, collector = WeightClient(server.address), WeightClient(server.address)

        seen: list[int] = []
        all_seen = threading.Event()

        def watch() -> None:
            with WeightClient(server.address) as watcher:
                for event in watcher.watch(args.model, since=0, timeout=60):
                    print(f"watch     {event.info.model} v{event.version} landed, sha256 {event.info.sha256[:16]}")
                    seen.append(event.version)
                    if len(seen) == args.versions:
                        all_seen.set()
                        return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        policy = make_policy()
        digests: dict[int, str] = {}
        for step in range(1, args.versions + 1):
            with torch.no_grad():  # stand-in for an optimizer step
                for p in policy.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            version = trainer.publish(policy, model=args.model, metadata={"step": str(step * 1000)})
            digests[version] = trainer.describe(args.model, version).sha256
            print(f"publish   {args.model} v{version} (step {step * 1000}) sha256 {digests[version][:16]}")

        local = make_policy()
        latest = collector.fetch(args.model)
        assert latest is not None
        local.load_state_dict(latest.state_dict())
        x = torch.randn(4, 8)
        same = torch.equal(local(x), policy(x))
        print(f"fetch     latest -> v{latest.version} {latest.metadata}; collector output == trainer output: {same}")
        print(
            f"fetch     newer_than={latest.version} -> {collector.fetch(args.model, newer_than=latest.version)}"
            " (up to date, nothing transferred)"
        )
        first = collector.fetch(args.model, version=1)
        assert first is not None
        print(f"fetch     version=1 -> v{first.version} sha256 {first.info.sha256[:16]}")
        if not all_seen.wait(30):
            raise SystemExit(f"watcher saw {seen}, expected {args.versions} versions")
        print(f"watch     saw versions {seen}")
        trainer.close()
        collector.close()

        server.stop()
        server.start()
        print(f"restart   server back on {server.address}")
        with WeightClient(server.address) as after:
            restored = {v.version: v.sha256 for v in after.list_versions(args.model)}
        intact = restored == digests
        print(f"restart   versions {sorted(restored)} restored, digests match: {intact}")
        ok = same and intact and seen == list(range(1, args.versions + 1))
    print("OK: publish, watch, fetch and restart round trip complete" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
