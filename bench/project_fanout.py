"""Project a relay tree's freshness and origin egress to many collectors, from measured figures.

    .venv/bin/python bench/project_fanout.py --collectors 1000 --fanout 8 --link-gbps 10 \\
        --model-mib 100 [--results bench/results.json] [--hop-ms MS] [--fixed-ms MS]

The per-hop figures come from the `fanout_tree` row of a `bench/run.py --json` results file
(`--results`, default bench/results.json), or from `--hop-ms` and `--fixed-ms`, which win:

- fixed (`--fixed-ms`): the single collector's median freshness on loopback
  (`fanout_tree_single`: publish call, commit, announcement and one collector's fetch of a
  16 MiB model). Taken whole as a fixed cost per publish: it also holds two loopback transfers
  of the measured model, so it overstates the fixed part.
- hop (`--hop-ms`): what one relay level added in the same run, the tree's p50 minus the
  single collector's median (a relay receiving by cut-through, committing once its upstream's
  commit is announced, announcing, and 8 collectors reading it). Taken as a fixed cost per
  level, not scaled with the model; on the 2-core bench machine every process shares the
  cores, so it overstates a level on hosts of their own.

The model (stated in the output too):

- The tree: every node (the primary, a relay) sends to at most `fanout` children; collectors
  are the leaves. Relay levels are added from the bottom (ceil(collectors / fanout) relays
  feed the collectors, ceil(that / fanout) feed those, ...) until at most `fanout` nodes
  remain, which the primary feeds. Every hop crosses a link (collectors on other hosts than
  their relay; a collector on its relay's host reads shared memory instead, faster).
- Links: each node has one full-duplex NIC of `link_gbps`; the network between them is not a
  bottleneck. Sending one version to k children takes k x model / link.
- Cut-through: every level forwards bytes while they arrive, so the transfers of all levels
  overlap and the slowest node's egress (the most children x model / link) bounds the transfer
  once; each level adds its hop cost plus one chunk's time on the link (`--chunk-mib`) plus one
  pass to verify the model before it commits (`--verify-gbps`, xxh3 on the bench machine).
- freshness = fixed + max children x model / link + levels x (hop + chunk / link + model /
  verify). Without a tree the primary sends to every collector: fixed + collectors x model / link.
- Origin egress per version = the primary's children x model (at most fanout x model),
  whatever the number of collectors; a relay's egress = its children x model. The busiest
  node's link is full at link / (max children x model) publishes per second.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results.json"
XXH3_GBPS = 9.0  # xxh3_128 on the bench machine class (../shared/REFERENCE.md)


@dataclass(frozen=True)
class Measured:
    """Per-hop figures: a fixed cost per publish and the cost one relay level adds, in ms."""

    fixed_ms: float
    hop_ms: float
    source: str


@dataclass(frozen=True)
class Projection:
    collectors: int
    fanout: int
    link_gbps: float
    model_bytes: int
    relay_levels: list[int]  # relays per level, from the primary's children down
    primary_children: int
    max_children: int
    link_transfer_ms: float  # one model over one link
    transfer_ms: float  # the slowest node's egress: max children x one model
    per_level_ms: float  # hop + one chunk on the link + one verifying pass
    freshness_ms: float
    direct_freshness_ms: float  # no tree: the primary sends to every collector
    origin_egress_bytes: int  # per version
    direct_origin_egress_bytes: int
    relay_egress_bytes: int  # per version, a relay with `fanout` children
    max_publishes_per_second: float  # before the busiest node's link is full


def relay_levels(collectors: int, fanout: int) -> list[int]:
    """Relays per level, top (the primary's children) first: the bottom level has
    ceil(collectors / fanout) relays, each level above ceil(below / fanout), until at most
    `fanout` nodes remain for the primary to feed. [] when the primary feeds every collector.

    >>> relay_levels(1000, 8)
    [2, 16, 125]
    >>> relay_levels(32, 8)
    [4]
    """
    if collectors < 1 or fanout < 2:
        raise ValueError(f"need at least 1 collector and a fan-out of at least 2, got {collectors} and {fanout}")
    levels: list[int] = []
    nodes = collectors
    while nodes > fanout:
        nodes = math.ceil(nodes / fanout)
        levels.append(nodes)
    return levels[::-1]


def transfer_ms(nbytes: int, link_gbps: float) -> float:
    """Milliseconds to send `nbytes` over a link of `link_gbps` gigabits per second."""
    return nbytes * 8 / (link_gbps * 1e9) * 1e3


def project(
    collectors: int,
    fanout: int,
    link_gbps: float,
    model_bytes: int,
    measured: Measured,
    chunk_bytes: int = MiB,
    verify_gbps: float = XXH3_GBPS,
) -> Projection:
    """Freshness and egress of a tree of relays feeding `collectors` (see the module docstring)."""
    if link_gbps <= 0 or verify_gbps <= 0 or model_bytes <= 0:
        raise ValueError("link_gbps, verify_gbps and model_bytes must be positive")
    levels = relay_levels(collectors, fanout)
    primary_children = levels[0] if levels else collectors
    max_children = min(fanout, collectors)
    one = transfer_ms(model_bytes, link_gbps)
    per_level = measured.hop_ms + transfer_ms(min(chunk_bytes, model_bytes), link_gbps)
    per_level += model_bytes / (verify_gbps * 1e9) * 1e3
    freshness = measured.fixed_ms + max_children * one + len(levels) * per_level
    return Projection(
        collectors=collectors,
        fanout=fanout,
        link_gbps=link_gbps,
        model_bytes=model_bytes,
        relay_levels=levels,
        primary_children=primary_children,
        max_children=max_children,
        link_transfer_ms=one,
        transfer_ms=max_children * one,
        per_level_ms=per_level,
        freshness_ms=freshness,
        direct_freshness_ms=measured.fixed_ms + collectors * one,
        origin_egress_bytes=primary_children * model_bytes,
        direct_origin_egress_bytes=collectors * model_bytes,
        relay_egress_bytes=max_children * model_bytes,
        max_publishes_per_second=1e3 / (max_children * one),
    )


def measured_from_results(path: Path) -> Measured:
    """fixed = the single collector's median, hop = the tree's p50 minus it (never below 0),
    from the `fanout_tree` row of a bench/run.py results file."""
    rows = json.loads(path.read_text())["rows"]
    row = next((r for r in rows if r["name"] == "fanout_tree" and r["status"] == "ok"), None)
    if row is None:
        raise ValueError(f"{path} has no measured fanout_tree row: run bench/run.py --only fanout_tree --json {path}")
    extra = row["extra"]
    fixed, tree = extra["single_median_ms"], extra["p50_ms"]
    return Measured(fixed, max(0.0, tree - fixed), f"{path} (fanout_tree, {extra['file_bytes']} byte model)")


def report(p: Projection, measured: Measured, publishes_per_second: float) -> str:
    gb = 1e9
    levels = " -> ".join(str(n) for n in p.relay_levels) or "none"
    lines = [
        f"{p.collectors} collectors, fan-out {p.fanout}, {p.link_gbps:g} Gb/s links, model {p.model_bytes / MiB:g} MiB",
        f"  measured: fixed {measured.fixed_ms:.1f} ms per publish, {measured.hop_ms:.1f} ms per relay level "
        f"({measured.source})",
        f"  relays per level (primary's children first): {levels} ({sum(p.relay_levels)} relays, "
        f"{len(p.relay_levels)} levels)",
        f"  one model over one link: {p.link_transfer_ms:.1f} ms; slowest node sends {p.max_children} copies: "
        f"{p.transfer_ms:.1f} ms; each level adds {p.per_level_ms:.1f} ms",
        f"  freshness (publish call -> every collector has it): {p.freshness_ms:.0f} ms "
        f"(without relays: {p.direct_freshness_ms:.0f} ms)",
        f"  origin egress per version: {p.origin_egress_bytes / MiB:g} MiB = {p.primary_children}x the model "
        f"(without relays: {p.direct_origin_egress_bytes / MiB:,.0f} MiB); at {publishes_per_second:g} publishes/s: "
        f"{p.origin_egress_bytes * publishes_per_second * 8 / gb:.2f} Gb/s "
        f"(without relays: {p.direct_origin_egress_bytes * publishes_per_second * 8 / gb:.0f} Gb/s)",
        f"  a relay's egress per version: {p.relay_egress_bytes / MiB:g} MiB "
        f"({p.relay_egress_bytes * publishes_per_second * 8 / gb:.2f} Gb/s at {publishes_per_second:g}/s); "
        f"the busiest link is full at {p.max_publishes_per_second:.2f} publishes/s",
    ]
    if publishes_per_second > p.max_publishes_per_second:
        lines.append(
            f"  note: {publishes_per_second:g} publishes/s is more than the busiest node's link carries; "
            "versions would queue or be skipped"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--collectors", type=int, default=1000, help="default: %(default)s")
    parser.add_argument("--fanout", type=int, default=8, help="children per node (default: %(default)s)")
    parser.add_argument("--link-gbps", type=float, default=10.0, help="each node's NIC (default: %(default)s)")
    parser.add_argument("--model-mib", type=float, action="append", help="model size(s), repeatable (default: 100)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="bench/run.py --json output")
    parser.add_argument("--fixed-ms", type=float, help="fixed cost per publish, ms (instead of --results)")
    parser.add_argument("--hop-ms", type=float, help="cost one relay level adds, ms (instead of --results)")
    parser.add_argument("--chunk-mib", type=float, default=1.0, help="chunk size on the wire (default: %(default)s)")
    parser.add_argument(
        "--verify-gbps", type=float, default=XXH3_GBPS, help="digest check at each relay (default: %(default)s)"
    )
    parser.add_argument("--publishes-per-second", type=float, default=2.0, help="for egress rates (default: 2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fixed_ms is not None and args.hop_ms is not None:
        measured = Measured(args.fixed_ms, args.hop_ms, "--fixed-ms, --hop-ms")
    else:
        try:
            measured = measured_from_results(args.results)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}; or give both --fixed-ms and --hop-ms", file=sys.stderr)
            return 2
        if args.fixed_ms is not None or args.hop_ms is not None:
            measured = Measured(
                measured.fixed_ms if args.fixed_ms is None else args.fixed_ms,
                measured.hop_ms if args.hop_ms is None else args.hop_ms,
                measured.source + ", overridden by flags",
            )
    for model_mib in args.model_mib or [100.0]:
        projection = project(
            args.collectors,
            args.fanout,
            args.link_gbps,
            int(model_mib * MiB),
            measured,
            chunk_bytes=int(args.chunk_mib * MiB),
            verify_gbps=args.verify_gbps,
        )
        print(report(projection, measured, args.publishes_per_second))
    return 0


if __name__ == "__main__":
    sys.exit(main())
