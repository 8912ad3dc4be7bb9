"""Publish at wire speed, and freshness: the rows of issue 15.

- `publish_bulk` / `publish_shm`: the trainer blocked in `publish(..., transport=...)` until
  the version is committed, over the bulk TCP path / shared memory, against one raw TCP
  transfer / one memcpy of the same bytes (the suite's `raw_tcp` / `memcpy` rows).
- `freshness_remote` / `freshness_local` / `freshness_8`: from the trainer's `publish()` call
  until every collector process (a `GrpcLocalWeightUpdater(watch=True)` applying to its live
  policy) holds the new version, wall clock: 2 collectors over bulk, 2 over shared memory, 8
  over bulk; against one raw TCP transfer, TorchRL's own `MultiSyncCollector` shared-memory
  sync (`torchrl_shared_mem`) and `freshness_remote` at the same size.

A client whose `publish` has no `transport=` gets the two publish rows as n/a and the
freshness rows measured with its stream publish (said in the note).
"""

from __future__ import annotations

import inspect
import multiprocessing
import queue
import re
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from bench import workers
from bench.baselines import IDLE_GAP_SECONDS
from bench.common import WARMUP_ROUNDS, Row, cpu_seconds, format_size, log, not_available
from bench.models import FlatPolicy
from bench.rows import Context, compare
from bench.torchrl_sync import make_policy as torchrl_policy
from weightclient import WeightClient

SPAWN = multiprocessing.get_context("spawn")
LOCAL_COLLECTORS = 2
MANY_COLLECTORS = 8
APPLY_TIMEOUT = 300.0

PUBLISH_BULK_TARGET = 1.3  # x one raw TCP transfer
PUBLISH_SHM_TARGET = 2.0  # x one memcpy
# x torchrl MultiSyncCollector(2 workers) shared-memory sync, by size (issue 30; larger: as 256 MiB)
FRESHNESS_LOCAL_TARGETS = {16 << 20: 1.5, 256 << 20: 1.2}
BACK_TO_BACK = "torchrl's scheme back to back (no idle)"  # beside the judged ratio, both after idle
RAW_FANOUT_TARGET = 1.3  # freshness_remote, freshness_8: x raw_fanout of the same topology (issue 31)
# Untimed pause before each timed publish: a trainer trains between publishes, and what the
# last publish left running in the background (the server's sha256 of it, the next upload
# set up ahead) would otherwise share the cores with the one being timed.
PUBLISH_GAP_SECONDS = IDLE_GAP_SECONDS  # idle before each publish, as a trainer trains


def shared_memory_pages() -> str:
    """Which pages a same-host upload gets on this host (the figures depend on it)."""
    from weightserver.protocol.page_tables import HUGE_SETTINGS, SHMEM_HUGE_PAGES, shared_huge_pages

    setting = shared_huge_pages()
    pages = "2 MiB" if setting in HUGE_SETTINGS else "4 KiB"
    return f"shared memory in {pages} pages ({SHMEM_HUGE_PAGES.rsplit('/', 1)[-1]}={setting})"


def publish_transports() -> bool:
    """Whether `WeightClient.publish` takes `transport=` (publish over bulk / shared memory): it
    passes its options on to `publish_group_bytes`."""
    return "transport" in inspect.signature(WeightClient.publish_group_bytes).parameters


def publish_kwargs(transport: str) -> dict[str, str]:
    return {"transport": transport} if publish_transports() else {}


def _server_publish_transports(ctx: Context, model: str) -> dict[int, str]:
    """{version: transport} of `model`'s publishes, from the server's log lines
    (`publish model=M version=V ... transport=T`): the path that actually carried each."""
    return server_publish_transports(ctx.server.log(), model)


def server_publish_transports(server_log: str, model: str) -> dict[int, str]:
    """`_server_publish_transports` of a server log's text."""
    found = re.findall(rf"publish model={re.escape(model)} version=(\d+) .*?transport=(\w+)", server_log)
    return {int(version): transport for version, transport in found}


@torch.no_grad()
def _mark(weights: torch.nn.Module, value: float) -> None:
    """Write `value` at both ends of every parameter: each publish differs in every tensor
    (so a delta fetch carries the whole model, as after a real training step), and a
    collector's copy is checked at both ends of each."""
    for param in weights.parameters():
        param.view(-1)[0] = value
        param.view(-1)[-1] = value


# ---------------------------------------------------------------------- publish rows
def _publish_row(ctx: Context, size: int, transport: str, name: str) -> tuple[Row, set[str]]:
    """`publish(weights, model=..., transport=transport)` blocked until committed, in ms."""
    weights = FlatPolicy(size, 4, fill=3.0)
    model = f"{name}-{format_size(size)}"
    kwargs = publish_kwargs(transport)
    for i in range(WARMUP_ROUNDS):
        _mark(weights, float(-1 - i))
        ctx.client.publish(weights, model=model, **kwargs)
    seconds, versions = [], []
    for i in range(ctx.repeats):
        _mark(weights, float(i))  # untimed: every version differs
        time.sleep(PUBLISH_GAP_SECONDS)
        start = time.perf_counter()
        versions.append(ctx.client.publish(weights, model=model, **kwargs))
        seconds.append(time.perf_counter() - start)
    carried = _server_publish_transports(ctx, model)
    used = {carried.get(v, "unknown") for v in versions}
    ctx.drop(model)
    row = Row(name, size, "ms", [s * 1e3 for s in seconds])
    row.extra = {"seconds": seconds, "versions": versions, "server_transports": [carried.get(v) for v in versions]}
    row.note = f"publish(transport={transport}) until committed; carried by {'/'.join(sorted(used))} (server log)"
    if transport == "shm":
        row.note += f"; {shared_memory_pages()}"
    if used != {transport}:
        row.note += f"; NOT {transport}"
    return row, used


def publish_bulk(ctx: Context, size: int) -> list[Row]:
    """The trainer blocked in `publish(transport="bulk")` until committed, vs one raw TCP
    transfer of the same bytes (the suite's `raw_tcp`)."""
    target = f"ratio <= {PUBLISH_BULK_TARGET:g}x"
    if not publish_transports():
        return [not_available("publish_bulk", size, "ms", target, "WeightClient.publish has no transport=")]
    row, _ = _publish_row(ctx, size, "bulk", "publish_bulk")
    after_idle = f"one raw TCP transfer after the same {IDLE_GAP_SECONDS:g} s idle"
    _ratio_to(row, "raw_tcp_after_idle", ctx.baseline("raw_tcp_after_idle", size), after_idle)
    return [compare(row, ctx.baseline("raw_tcp", size), "<=", PUBLISH_BULK_TARGET, time_based=True)]


def publish_shm(ctx: Context, size: int) -> list[Row]:
    """The trainer blocked in `publish(transport="shm")` until committed, vs a memcpy of the
    weights (the suite's `memcpy`)."""
    target = f"ratio <= {PUBLISH_SHM_TARGET:g}x"
    if not publish_transports():
        return [not_available("publish_shm", size, "ms", target, "WeightClient.publish has no transport=")]
    row, _ = _publish_row(ctx, size, "shm", "publish_shm")
    after_idle = f"one memcpy after the same {IDLE_GAP_SECONDS:g} s idle"
    _ratio_to(row, "memcpy_after_idle", ctx.baseline("memcpy_after_idle", size), after_idle)
    return [compare(row, ctx.baseline("memcpy", size), "<=", PUBLISH_SHM_TARGET, time_based=True)]


# ---------------------------------------------------------------------- freshness
class Collectors:
    """`count` collector processes (`workers.freshness_collector`), each following `model`
    with `GrpcLocalWeightUpdater(watch=True, transport=transport)` into a live policy of
    `shapes`. `start()` returns once each applied the model's current version and follows the
    Watch stream; `applied(version)` waits for every collector to report that version.
    `options`: more keyword arguments of each collector's updater (`freshness_collector`);
    `spawn_in(i)`: a context collector i's process is started in (`Link.spawning_in`: its
    network namespace)."""

    def __init__(
        self,
        count: int,
        address: str,
        model: str,
        shapes: list[int] | int,
        transport: str,
        incoming: bool = True,
        target: Callable[..., None] = workers.freshness_collector,
        options: Mapping[str, Any] | None = None,
        spawn_in: Callable[[int], AbstractContextManager[object]] | None = None,
    ) -> None:
        self.count = count
        self.spawn_in = spawn_in
        extra = (dict(options),) if options else ()
        self.stop = SPAWN.Event()
        self.results = SPAWN.Queue()
        self.reports: dict[int, dict[int, tuple[float, str, list[tuple[float, float]], bool, bool]]] = {}
        self.processes = [
            SPAWN.Process(
                target=target,
                args=(i, address, model, shapes, transport, self.stop, self.results, incoming, *extra),
                daemon=target is workers.freshness_collector,  # a daemon cannot start torchrl's workers
                name=f"bench-collector-{i}",
            )
            for i in range(count)
        ]

    def start(self, timeout: float = 300.0) -> Collectors:
        for i, process in enumerate(self.processes):
            with self.spawn_in(i) if self.spawn_in else nullcontext():
                process.start()
        ready: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ready) < self.count:
            message = self._next(deadline)
            if message[0] == "ready":
                ready.add(message[1])
        return self

    def _next(self, deadline: float) -> tuple:
        while True:
            try:
                message = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"collectors died: {', '.join(dead)}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("collectors did not report in time") from None
                continue
            if message[0] != "ready":
                index, version, at, used, ends, early, zero_copy = message
                self.reports.setdefault(index, {})[version] = (at, used, ends, early, zero_copy)
            return message

    def applied(self, version: int, timeout: float = APPLY_TIMEOUT) -> dict[int, tuple[float, str, list, bool, bool]]:
        """{collector: (monotonic time it applied `version`, transport, parameter ends, whether
        it was received before its commit, whether applied zero-copy)} once every collector
        applied it (a collector that skipped it for a newer one fails)."""
        deadline = time.monotonic() + timeout
        while any(version not in self.reports.get(i, {}) for i in range(self.count)):
            self._next(deadline)
        return {i: self.reports[i][version] for i in range(self.count)}

    def close(self) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)

    def __enter__(self) -> Collectors:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class TimedPublishes:
    """What `timed_publishes` measured: per timed publish, freshness (call -> last collector
    applied), how long `publish()` took and each collector's latency, in ms; over all of them
    the transports that carried the fetches and how many applications held wrong weights,
    were received before the commit (cut-through) and were applied zero-copy."""

    samples: list[float] = field(default_factory=list)
    publish_ms: list[float] = field(default_factory=list)
    per_collector: list[list[float]] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    wrong: int = 0
    early: int = 0
    zero_copy: int = 0
    cpu_per_cycle: dict[str, float] = field(default_factory=dict)


def timed_publishes(
    group: Collectors,
    repeats: int,
    publish: Callable[[int], tuple[int, float, float, float | None]],
    pids: Mapping[str, int | str] | None = None,
) -> TimedPublishes:
    """WARMUP_ROUNDS untimed, then `repeats` timed publishes, one at a time: `publish(i)`
    returns (version, monotonic time of the publish call, time it returned, the value every
    parameter's ends hold in that version or None: not checked); each waits until every
    collector of `group` applied the version. `pids` (role: pid, "self" for this process):
    the CPU seconds each used per cycle (idle gap, publish, applications and what runs after
    them, such as the server's sha256 pass), from the first timed publish to the last one's start."""
    timed = TimedPublishes()
    cycles: list[dict[str, float]] = []
    for i in range(WARMUP_ROUNDS + repeats):
        if pids and i >= WARMUP_ROUNDS:
            cycles.append({role: cpu_seconds(pid) for role, pid in pids.items()})
        version, called, returned, value = publish(i)
        applied = group.applied(version)
        if i < WARMUP_ROUNDS:
            continue
        stamps = [applied[c][0] for c in range(group.count)]
        timed.samples.append((max(stamps) - called) * 1e3)
        timed.publish_ms.append((returned - called) * 1e3)
        timed.per_collector.append([(at - called) * 1e3 for at in stamps])
        for _, via, ends, before_commit, swapped in applied.values():
            timed.used.add(via)
            timed.wrong += value is not None and any(end != (value, value) for end in ends)
            timed.early += before_commit
            timed.zero_copy += swapped
    if len(cycles) > 1:
        timed.cpu_per_cycle = {role: (cycles[-1][role] - cycles[0][role]) / (len(cycles) - 1) for role in cycles[0]}
    return timed


def _freshness_row(
    ctx: Context, size: int, name: str, collectors: int, transport: str, incoming: bool = True, multi: bool = False
) -> Row:
    """Freshness in ms: `time.monotonic()` just before the publisher's `publish()` call ->
    the latest of the collectors' `time.monotonic()` stamps, each taken right after its
    updater returned with that version in the live policy. One publish at a time: the next
    starts once every collector applied the previous one. `transport` "auto": the defaults,
    no transport named on either side. `multi`: one `freshness_multi_collector` (its 2 workers)."""
    weights: torch.nn.Module = torchrl_policy(size) if multi else FlatPolicy(size, 4, fill=0.0)
    model = f"{name}-{format_size(size)}"
    kwargs = publish_kwargs(transport) if transport != "auto" else {}
    _mark(weights, -100.0)
    ctx.client.publish(weights, model=model, **kwargs)  # a version to start from
    log(f"{name} {format_size(size)}: starting {collectors} collector processes ({transport})")
    shapes = size if multi else weights.shapes()
    target = workers.freshness_multi_collector if multi else workers.freshness_collector

    def publish(i: int) -> tuple[int, float, float, float]:
        value = float(i)
        _mark(weights, value)  # untimed
        time.sleep(PUBLISH_GAP_SECONDS)
        called = time.monotonic()
        version = ctx.client.publish(weights, model=model, **kwargs)
        return version, called, time.monotonic(), value

    with Collectors(collectors, ctx.address, model, shapes, transport, incoming, target) as group:
        pids = {"server": ctx.server.process.pid, "bench (publisher)": "self"}
        pids |= {f"collector{i}": process.pid for i, process in enumerate(group.processes)}
        timed = timed_publishes(group, ctx.repeats, publish, pids)
    if timed.cpu_per_cycle:
        used_cpu = ", ".join(f"{role} {seconds:.2f}" for role, seconds in timed.cpu_per_cycle.items())
        log(f"{name} {format_size(size)}: CPU seconds per publish cycle: {used_cpu}")
    samples, publish_ms, per_collector, used = timed.samples, timed.publish_ms, timed.per_collector, timed.used
    wrong, early, zero_copy = timed.wrong, timed.early, timed.zero_copy
    ctx.drop(model)
    row = Row(name, size, "ms", samples)
    carried = set(_server_publish_transports(ctx, model).values())
    published_via = "/".join(sorted(carried or {"unknown"}))
    who = (
        "MultiSyncCollector(2 workers) through GrpcWeightSyncScheme(watch=True)"
        if multi
        else f"{collectors} collector processes (GrpcLocalWeightUpdater(watch=True, transport={transport}, "
        f"incoming={incoming}))"
    )
    applications = collectors * ctx.repeats
    row.note = (
        f"publish({'' if not kwargs else 'transport=' + transport}) call -> {who} applied, woken by a Watch "
        f"event, wall clock; fetched via {'/'.join(sorted(used))}, {early} of {applications} received before the "
        f"commit (cut-through), {zero_copy} of {applications} applied zero-copy; published via {published_via}; "
        f"publish() returned after {statistics.median(publish_ms):.1f} ms (median)"
    )
    if not kwargs and transport != "auto":
        row.note += " (publish has no transport=: stream publish)"
    if transport != "auto" and used != {transport}:
        row.note += f"; fetches FELL BACK from {transport}"
    if kwargs and carried != {transport}:
        row.note += f"; publishes NOT {transport}"
    if transport == "auto" and (used != {"shm"} or carried != {"shm"}):
        row.note += "; the defaults did NOT take shared memory on the server's host"
    if "shm" in used:
        row.note += f"; {shared_memory_pages()}"
    if wrong:
        row.note += f"; WRONG WEIGHTS in {wrong} applications"
    row.extra = {
        "collectors": collectors,
        "transport": transport,
        "publish_kwargs": kwargs,
        "publish_returned_ms": publish_ms,
        "per_collector_ms": per_collector,
        "fetch_transports": sorted(used),
        "publish_transports": sorted(carried),
        "wrong_weights": wrong,
        "incoming": incoming,
        "received_before_commit": early,
        "applied_zero_copy": zero_copy,
        "cpu_seconds_per_cycle": timed.cpu_per_cycle,
    }
    return row


def freshness_remote(ctx: Context, size: int) -> list[Row]:
    """Publish call -> 2 collector processes applied, over bulk, judged against `raw_fanout` (the
    raw limit of the same topology: a forwarder passing each MiB on to 2 receivers); the ratio
    to one raw TCP transfer (the target before issue 31: <= 2x) is kept as a reported column."""
    row = _freshness_row(ctx, size, "freshness_remote", LOCAL_COLLECTORS, "bulk")
    ctx.baselines[("freshness_remote", size)] = row
    _ratio_to(row, "raw_tcp", ctx.baseline("raw_tcp", size), "one raw TCP transfer")
    return [compare(row, ctx.baseline("raw_fanout", size), "<=", RAW_FANOUT_TARGET, time_based=True)]


def _ratio_to(row: Row, name: str, base: Row | None, what: str, series: str = "seconds") -> None:
    """Reported beside the judged ratio: `row`'s ratio to `base`, the median of its raw durations
    `extra[series]` (a baseline row), else its median (a row in ms)."""
    if base is None or row.median is None or not base.median:
        return
    durations = base.extra.get(series)
    milliseconds = statistics.median(durations) * 1e3 if durations else base.median if base.unit == "ms" else None
    if milliseconds:
        row.extra[f"ratio_to_{name}"] = ratio = row.median / milliseconds
        row.note += f"; {ratio:.2f}x {what}"


def freshness_remote_no_cut_through(ctx: Context, size: int) -> list[Row]:
    """freshness_remote with `incoming=False`: each collector fetches a version once its
    commit is announced. Report only: what cut-through changes, measured in the same run."""
    row = _freshness_row(ctx, size, "freshness_remote_no_cut_through", LOCAL_COLLECTORS, "bulk", incoming=False)
    row.target = "none (reported)"
    remote = ctx.baseline("freshness_remote", size)
    if remote is not None:
        row.baseline, row.baseline_value = f"freshness_remote {format_size(size)}", remote.median
        row.ratio = row.median / remote.median
    return [row]


def freshness_local(ctx: Context, size: int) -> list[Row]:
    """The same on the server's host with the documented defaults (no transport named: shared
    memory, zero-copy apply), vs torchrl's MultiSyncCollector(2 workers) shared-memory weight
    sync (`torchrl_shared_mem`, which also waits for both workers' acknowledgement)."""
    row = _freshness_row(ctx, size, "freshness_local", LOCAL_COLLECTORS, "auto")
    target = FRESHNESS_LOCAL_TARGETS.get(size, FRESHNESS_LOCAL_TARGETS[max(FRESHNESS_LOCAL_TARGETS)])
    _ratio_to(row, "torchrl_back_to_back", ctx.baseline("torchrl_shared_mem", size), BACK_TO_BACK, "hot_seconds")
    return [compare(row, ctx.baseline("torchrl_shared_mem", size), "<=", target, time_based=True)]


def freshness_local_multi(ctx: Context, size: int) -> list[Row]:
    """A MultiSyncCollector(2 workers) following through GrpcWeightSyncScheme (defaults), against
    torchrl's own scheme in the same collector (`torchrl_shared_mem`). Reported: its workers keep
    their parameters in torchrl's shared buffers, so each version is copied once."""
    row = _freshness_row(ctx, size, "freshness_local_multi", 1, "auto", multi=True)
    _ratio_to(row, "torchrl_back_to_back", ctx.baseline("torchrl_shared_mem", size), BACK_TO_BACK, "hot_seconds")
    judged = compare(row, ctx.baseline("torchrl_shared_mem", size), "<=", 1.0, time_based=True)
    judged.target, judged.passed = "none (reported)", None
    return [judged]


def freshness_8(ctx: Context, size: int) -> list[Row]:
    """As freshness_remote with 8 collectors, judged against `raw_fanout` to 8 receivers measured
    here (the same topology's raw limit); reported beside: the ratio to freshness_remote at the
    same size (the target before issue 31: <= 1.5x) and to one raw TCP transfer."""
    from bench.raw_fanout import raw_fanout

    fanout = raw_fanout(size, ctx.repeats, receivers=MANY_COLLECTORS, name="raw_fanout_8")
    row = _freshness_row(ctx, size, "freshness_8", MANY_COLLECTORS, "bulk")
    _ratio_to(row, "freshness_remote", ctx.baseline("freshness_remote", size), "freshness_remote")
    _ratio_to(row, "raw_tcp", ctx.baseline("raw_tcp", size), "one raw TCP transfer")
    return [fanout, compare(row, fanout, "<=", RAW_FANOUT_TARGET, time_based=True)]


SIZED_ROWS = {
    "publish_bulk": publish_bulk,
    "publish_shm": publish_shm,
    "freshness_remote": freshness_remote,
    "freshness_remote_no_cut_through": freshness_remote_no_cut_through,
    "freshness_local": freshness_local,
    "freshness_local_multi": freshness_local_multi,
    "freshness_8": freshness_8,
}
ROW_ORDER = list(SIZED_ROWS)
# The in-run baselines each row is compared with (freshness_8 measures freshness_remote itself
# when the run did not include it).
NEEDS = {
    "publish_bulk": ["raw_tcp", "raw_tcp_after_idle"],
    "publish_shm": ["memcpy", "memcpy_after_idle"],
    "freshness_remote": ["raw_tcp", "raw_fanout"],
    "freshness_remote_no_cut_through": ["raw_tcp"],
    "freshness_local": ["torchrl_shared_mem"],
    "freshness_local_multi": ["torchrl_shared_mem"],
    "freshness_8": ["raw_tcp"],
}
