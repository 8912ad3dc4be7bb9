"""Benchmark suite for weightserver: every row against a baseline measured in the same run.

    .venv/bin/python bench/run.py [--sizes 16MiB,256MiB] [--large] [--repeats 5]
                                  [--json bench/results.json] [--only ROW,ROW] [--plots DIR | --no-plots]

--large adds 1GiB to the sizes and the report-only 4 GiB round trip (bench/large.py).

Prints a table (median of the repeats, min-max, unit, the baseline's median, the ratio, the
target and PASS/FAIL) and writes every raw sample to JSON, and the charts of that JSON
(bench/plots.py: freshness, throughput, trace bytes) as PNGs beside it. Progress goes to stderr. Rows whose
feature does not exist yet print "n/a (not implemented)". Baselines: memcpy, memcpy_after_idle, raw_tcp,
raw_tcp_after_idle, raw_fanout, gloo_broadcast, torchrl_shared_mem (see bench/baselines.py); rows: see bench/rows.py and
bench/freshness.py (publish over bulk / shared memory, publish-to-collector freshness),
bench/freshness_link.py (freshness over a shaped link between network namespaces, as root) and
bench/fanout_tree.py (a primary, 4 relays, 32 collectors: freshness and the primary's egress) and
bench/trace_rows.py (element deltas of two training traces, bench/traces.py: --trace-versions).
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `bench` is a package; spawned children inherit sys.path

# Module level stays standard library + bench.common (and bench.trace_rows, which imports only
# those at module level): spawned children re-import this file.
from bench.common import GiB, Row, cpu_busy, format_size, log, parse_size  # noqa: E402
from bench.trace_rows import ALIASES as TRACE_ALIASES  # noqa: E402

BASELINES = [
    "memcpy",
    "memcpy_after_idle",
    "raw_tcp",
    "raw_tcp_after_idle",
    "raw_fanout",
    "gloo_broadcast",
    "torchrl_shared_mem",
]
ALIASES = {
    "publish_blocked_async": "publish_blocked",
    "single_collector": "fanout_8",
    "updater_poll_asking": "updater_poll",
    "updater_poll_watch": "updater_poll",
    "publish_idle": "publish_under_fetch_load",
    "publish_under_niced_fetch_load": "publish_under_fetch_load",
    "fanout_tree_single": "fanout_tree",
    "raw_fanout_8": "freshness_8",
    "fanout_tree_direct": "fanout_tree",
    "fanout_tree_egress": "fanout_tree",
    "whole_fetch": "sharded_fetch",
    "sharded_fetch_bytes": "sharded_fetch",
    "sharded_fetch_alone": "sharded_fetch",
    "whole_fetch_alone": "sharded_fetch",
    "sharded_fetch_vs_alone": "sharded_fetch",
    **{name: "freshness_link" for name in ("raw_fanout_1gbit", "raw_fanout_10gbit")},
    **{name: "freshness_link" for name in ("freshness_link_1gbit", "freshness_link_10gbit")},
    **{name: "freshness_link_lm" for name in ("freshness_link_lm_full", "freshness_link_lm_delta")},
    **TRACE_ALIASES,
}


def row_registry() -> tuple[list[str], dict[str, Callable[..., list[Row]]], dict[str, list[str]]]:
    """(every row in table order, the sized rows' functions, the baselines each row needs)
    of bench/rows.py, bench/freshness.py and bench/sharded_fetch.py together, and
    bench/fanout_tree.py's row (servers of its own, at 16 MiB whatever --sizes says), and
    bench/freshness_link.py's (a link of its own), and bench/trace_rows.py's (training traces, on a
    server in this process)."""
    from bench import fanout_tree, freshness, freshness_link, relay_follow, rows, sharded_fetch, trace_rows

    return (
        [
            *rows.ROW_ORDER,
            *freshness.ROW_ORDER,
            sharded_fetch.ROW,
            freshness_link.ROW,
            freshness_link.LM_ROW,
            fanout_tree.ROW,
            relay_follow.ROW,
            *trace_rows.ROWS,
        ],
        {**rows.SIZED_ROWS, **freshness.SIZED_ROWS, **sharded_fetch.SIZED_ROWS},
        {**rows.NEEDS, **freshness.NEEDS},
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    row_order = row_registry()[0]
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="16MiB,256MiB", help="comma-separated sizes (default: %(default)s)")
    parser.add_argument(
        "--large", action="store_true", help="also run at 1GiB, and the 4 GiB round trip (roundtrip_4gib)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row and size (default: 5)")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results.json", help="raw results file")
    parser.add_argument(
        "--plots",
        type=Path,
        default=None,
        help="folder for the PNG charts of the results (bench/plots.py; default: the --json file's folder)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write no charts")
    parser.add_argument(
        "--transport",
        default="bulk",
        help="transport= for the network rows (fetch_live_policy, fanout_8, delta/cast, memory rows) when the "
        "client has one: bulk (default: what 'auto' picks for a collector on another host), stream, auto, shm",
    )
    parser.add_argument(
        "--trace-versions",
        type=int,
        default=8,
        help="versions of each training trace (trace_ddpg_delta, trace_lm_delta): the first, then one per "
        "publish interval (default: %(default)s)",
    )
    from bench.large import ROW as LARGE_ROW

    choices = [*BASELINES, *row_order, LARGE_ROW]
    parser.add_argument("--only", default="", help=f"comma-separated rows: {', '.join(choices)}")
    args = parser.parse_args(argv)
    args.sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()} | ({GiB} if args.large else set()))
    known = set(choices) | set(ALIASES)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in args.only if name not in known]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(choices)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.trace_versions < 2:
        parser.error("--trace-versions must be >= 2 (a delta needs a previous version)")
    return args


def guarded(name: str, size: int | None, fn: Callable[..., Row | list[Row]], *args: object) -> list[Row]:
    """Run one measurement; a failure becomes an ERROR row instead of ending the suite."""
    label = f"{name} {format_size(size) if size else ''}".strip()
    log(f"{label}: running")
    started = time.perf_counter()
    try:
        produced = fn(*args)
        rows = [produced] if isinstance(produced, Row) else produced
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        rows = [Row(name, size, "-", status="error", note=f"{type(exc).__name__}: {exc}"[:300])]
    for row in rows:
        summary = f"{row.median:.4g} {row.unit}" if row.status == "ok" and row.samples else row.status
        ratio = f", ratio {row.ratio:.3g}x" if row.ratio is not None else ""
        took = time.perf_counter() - started
        log(f"{row.name} {format_size(row.size) if row.size else ''}: {summary}{ratio} ({took:.1f}s)")
    return rows


def write_plots(results: Path, out: Path) -> None:
    """The charts of the results file (bench/plots.py) into `out`; without matplotlib, a line says
    they were skipped and how to get them (the results file is written either way)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("charts skipped: matplotlib is not installed (pip install matplotlib, or pip install -e '.[dev]')")
        return
    from bench.plots import plot_files

    plot_files([results], out)


def environment() -> dict[str, object]:
    """What the numbers depend on: versions, cores, load, commit."""
    import grpc
    import torch

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "grpcio": grpc.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "git_head": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench import baselines, fanout_tree, freshness_link, large, relay_follow, rows, trace_rows
    from weightclient import WeightClient
    from weightserver.process import ServerProcess

    row_order, sized_rows, needs = row_registry()
    everything = set(BASELINES) | set(row_order) | ({large.ROW} if args.large else set())
    wanted = {ALIASES.get(name, name) for name in args.only} or everything
    needed = {b for b in BASELINES if b in wanted}
    for row in wanted:
        needed |= set(needs.get(row, []))
    started, load_start, busy_start = time.perf_counter(), os.getloadavg(), cpu_busy()
    if busy_start > 0.1:
        log(f"warning: CPUs {busy_start:.0%} busy before the suite started: other work shares the cores")
    if args.repeats < 5:
        log(f"warning: --repeats {args.repeats}: medians of fewer than 5 runs are for quick checks only")
    log(f"sizes {', '.join(format_size(s) for s in args.sizes)}; repeats {args.repeats}; rows {sorted(wanted)}")
    results: list[Row] = []
    measured: dict[tuple[str, int], Row] = {}

    for name in (b for b in BASELINES if b != "torchrl_shared_mem"):  # (one subprocess for every size: below)
        if name in needed:
            for size in args.sizes:
                for row in guarded(name, size, getattr(baselines, name), size, args.repeats):
                    measured[(name, size)] = row
                    results.append(row)
    if "torchrl_shared_mem" in needed:
        for row in guarded("torchrl_shared_mem", None, baselines.torchrl_shared_mem, args.sizes, args.repeats):
            if row.size is not None:
                measured[("torchrl_shared_mem", row.size)] = row  # freshness_local's baseline
            results.append(row)

    server_rows = [r for r in row_order if r in wanted and (r in sized_rows or r in rows.UNSIZED_ROWS)]
    if server_rows:
        with ServerProcess() as server, WeightClient(server.address) as client:
            log(f"server pid {server.process.pid} on {server.address}, log {server.log_path}")
            ctx = rows.Context(server, client, args.repeats, transport=args.transport, baselines=measured)
            try:
                for name in server_rows:
                    if name in rows.UNSIZED_ROWS:
                        results += guarded(name, None, rows.UNSIZED_ROWS[name], ctx)
                        continue
                    for size in args.sizes:
                        results += guarded(name, size, sized_rows[name], ctx, size)
            finally:
                ctx.close()
    if "server_rss_16_fetchers" in wanted:
        results += guarded(
            "server_rss_16_fetchers", rows.RSS_SIZE, rows.server_rss_16_fetchers, args.repeats, args.transport
        )
    if freshness_link.ROW in wanted:  # namespaces, a server and collectors of its own, per link rate
        results += guarded(freshness_link.ROW, None, freshness_link.freshness_link, args.sizes, args.repeats)
    if freshness_link.LM_ROW in wanted:  # trace (b) on a 1 Gb/s link: whole versions against element deltas
        results += guarded(freshness_link.LM_ROW, None, freshness_link.freshness_link_lm, args.repeats)
    if fanout_tree.ROW in wanted:  # a primary, 4 relays and 32 collectors of its own
        results += guarded(fanout_tree.ROW, fanout_tree.SIZE, fanout_tree.fanout_tree, args.repeats, args.transport)
    if relay_follow.ROW in wanted:  # a primary and relays of its own, per transport
        results += guarded(relay_follow.ROW, relay_follow.SIZE, relay_follow.relay_follow, args.repeats)
    for name, function in trace_rows.ROW_FUNCTIONS.items():  # a server of their own, in this process
        if name in wanted:
            results += guarded(name, None, function, args.trace_versions, args.transport)
    if large.ROW in wanted:  # last, on a server of its own: it needs the memory the others held
        results += guarded(large.ROW, large.TENSOR_BYTES, large.roundtrip_4gib, args.repeats)

    elapsed = time.perf_counter() - started
    order = {
        name: i
        for i, name in enumerate(
            [
                *BASELINES,
                "single_collector",
                *row_order,
                *freshness_link.names(),
                f"{freshness_link.LM_ROW}_full",
                f"{freshness_link.LM_ROW}_delta",
                *fanout_tree.NAMES,
                *relay_follow.NAMES,
                *trace_rows.NAMES,
            ]
        )
    }
    results.sort(
        key=lambda r: (r.kind != "baseline", order.get(r.name, order.get(ALIASES.get(r.name, ""), 99)), r.size or 0)
    )
    from bench.report import format_table, write_json

    print(format_table(results))
    print(
        f"\n{len(results)} rows in {elapsed:.0f}s; repeats {args.repeats}; transport {args.transport}; "
        f"CPUs {busy_start:.0%} busy before start"
    )
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "elapsed_seconds": elapsed,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "transport": args.transport,
        "only": sorted(wanted),
        "cpu_busy_before_start": busy_start,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "fetch_parameters": list(rows.fetch_parameters()),
        "publish_parameters": list(inspect.signature(WeightClient.publish).parameters),
        **environment(),
    }
    write_json(args.json, results, meta)
    log(f"wrote {args.json}")
    if not args.no_plots:
        write_plots(args.json, args.plots or args.json.parent)
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
