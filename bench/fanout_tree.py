"""The relay tree row of issue 16: `fanout_tree`.

On loopback, in processes of their own: a primary (`weightserver serve --metrics-port P`),
4 relays (`--upstream primary`) and 8 collectors per relay (32), a 16 MiB policy of 4 float32
tensors published again and again (every version different). Three configurations, one after
the other, in the same run:

- `fanout_tree_single` (baseline): 1 collector fetching directly from the primary;
- `fanout_tree`: the 32 collectors, each following its relay (transport "auto": shared memory,
  since a relay runs on its collectors' host); the relays stand for other hosts, so the primary
  serves no shared memory (`--no-shm`) and they follow it over bulk TCP, which its egress counts
  (a same-host relay reads the primary's files with no call, which nothing on the primary sees);
- `fanout_tree_direct`: the same 32 collectors fetching directly from the primary.

Freshness is `time.monotonic()` just before the publisher's `publish()` call -> the latest of
the collectors' `time.monotonic()` stamps, each taken when its fetch of that version returned
(verified against the announced xxh3, which on a relay is the primary's). CLOCK_MONOTONIC is
one clock for every process on a Linux host. The primary's egress per version is read between
publishes from its own counters: `weightserver_fetch_bytes_total` of the model (every
transport; its /metrics) plus the bytes of the cut-through transfers (`fetch_incoming ...
bytes=N` in its log; the servicer's Fetch of incoming bytes does not count them in the
metrics).

Collectors are byte-level (`workers.tree_collectors`: `WeightServiceClient` threads, no torch),
8 threads per process, one process per relay, so 32 of them fit a 2-core, 24 GiB machine.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import re
import socket
import statistics
import time
import urllib.request

import torch

from bench import workers
from bench.common import WARMUP_ROUNDS, MiB, Row, format_size, log, percentile
from bench.freshness import PUBLISH_GAP_SECONDS, publish_kwargs
from bench.models import FlatPolicy
from weightclient import WeightClient
from weightclient.core.service_client import WeightServiceClient
from weightserver.process import ServerProcess
from weightserver.protocol.errors import ModelNotFound

ROW = "fanout_tree"
NAMES = (ROW, "fanout_tree_single", "fanout_tree_direct", "fanout_tree_egress")
SIZE = 16 * MiB
RELAYS = 4
PER_RELAY = 8
MIN_ROUNDS = 20  # timed publishes per configuration: a p99 needs more than 5
TREE_TARGET = 1.5  # p99 x the single direct collector's median
EGRESS_TARGET = 4.0  # x the model, per version, at the primary
APPLY_TIMEOUT = 120.0
MODEL = "fanout-tree"
PUBLISH_TRANSPORT = "bulk"  # a trainer on another host
_VALUES = itertools.count(1)  # written into each published version, so that every one differs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Egress:
    """The primary's payload bytes sent for `model`: its fetch counters (every transport) plus
    the cut-through transfers its log records (`fetch_incoming model=M bytes=N`)."""

    def __init__(self, server: ServerProcess, metrics_port: int, model: str) -> None:
        self.server, self.url, self.model = server, f"http://127.0.0.1:{metrics_port}/metrics", model
        self._counter = re.compile(
            rf'^weightserver_fetch_bytes_total\{{model="{re.escape(model)}",transport="(\w+)"\}} (\S+)$', re.M
        )
        self._arriving = re.compile(rf"fetch_incoming model={re.escape(model)} bytes=(\d+)")

    def read(self) -> dict[str, int]:
        """{transport: bytes so far} with "arriving" for the cut-through transfers."""
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            text = reply.read().decode()
        counts = {transport: int(float(value)) for transport, value in self._counter.findall(text)}
        counts["arriving"] = sum(int(n) for n in self._arriving.findall(self.server.log()))
        return counts


def _spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after.get(key, 0) - before.get(key, 0) for key in set(before) | set(after)}


class CollectorGroup:
    """`len(addresses)` collectors, `per_process` threads per process (`workers.tree_collectors`)."""

    def __init__(self, addresses: list[str], transport: str, per_process: int = PER_RELAY) -> None:
        self.count = len(addresses)
        self.stop = multiprocessing.get_context("spawn").Event()
        self.results = multiprocessing.get_context("spawn").Queue()
        self.reports: dict[int, dict[int, tuple[float, str, str]]] = {}
        spawn = multiprocessing.get_context("spawn")
        self.processes = [
            spawn.Process(
                target=workers.tree_collectors,
                args=(first, addresses[first : first + per_process], MODEL, transport, self.stop, self.results),
                daemon=True,
                name=f"bench-tree-collectors-{first}",
            )
            for first in range(0, self.count, per_process)
        ]

    def _next(self, deadline: float) -> tuple:
        while True:
            try:
                message = self.results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError("collectors did not report in time") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"collector {message[1]} failed: {message[2]}")
            if message[0] != "ready":
                index, version, at, used, xxh3 = message
                self.reports.setdefault(index, {})[version] = (at, used, xxh3)
            return message

    def __enter__(self) -> CollectorGroup:
        for process in self.processes:
            process.start()
        ready: set[int] = set()
        deadline = time.monotonic() + 120
        while len(ready) < self.count:
            message = self._next(deadline)
            if message[0] == "ready":
                ready.add(message[1])
        return self

    def applied(self, version: int) -> dict[int, tuple[float, str, str]]:
        """{collector: (monotonic time its fetch of `version` returned, transport, xxh3)}."""
        deadline = time.monotonic() + APPLY_TIMEOUT
        while any(version not in self.reports.get(i, {}) for i in range(self.count)):
            self._next(deadline)
        return {i: self.reports[i][version] for i in range(self.count)}

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)


@torch.no_grad()
def _mark(weights: FlatPolicy, value: float) -> None:
    for param in weights.parameters():
        param[0] = value
        param[-1] = value


def _measure(
    client: WeightClient, egress: Egress, weights: FlatPolicy, addresses: list[str], transport: str, rounds: int
) -> dict[str, object]:
    """Publish `WARMUP_ROUNDS + rounds` versions, one at a time, each `PUBLISH_GAP_SECONDS`
    after every collector fetched the previous; per timed round: freshness (ms), the primary's
    egress, each collector's latency."""
    kwargs = publish_kwargs(PUBLISH_TRANSPORT)
    freshness, published, egress_bytes, per_collector, used, wrong = [], [], [], [], set(), 0
    with CollectorGroup(addresses, transport) as group:
        for i in range(WARMUP_ROUNDS + rounds):
            _mark(weights, float(next(_VALUES)))  # untimed: every version differs
            before = egress.read()
            called = time.monotonic()
            version = client.publish(weights, model=MODEL, **kwargs)
            returned = time.monotonic()
            applied = group.applied(version)
            # Untimed: a trainer trains between publishes; the transfers and counters settle.
            time.sleep(PUBLISH_GAP_SECONDS)
            if i < WARMUP_ROUNDS:
                continue
            expected = client.describe(MODEL, version).xxh3
            stamps = [applied[c][0] for c in range(group.count)]
            freshness.append((max(stamps) - called) * 1e3)
            published.append((returned - called) * 1e3)
            per_collector.append([round((at - called) * 1e3, 3) for at in stamps])
            used |= {via for _, via, _ in applied.values()}
            wrong += sum(xxh3 != expected for _, _, xxh3 in applied.values())
            egress_bytes.append(_spent(before, egress.read()))
    return {
        "freshness_ms": freshness,
        "publish_returned_ms": published,
        "egress": egress_bytes,
        "per_collector_ms": per_collector,
        "transports": sorted(used),
        "wrong_digests": wrong,
    }


def _wait_following(address: str, version: int, timeout: float = 60.0) -> None:
    """Until the relay at `address` holds `version` of the model (it polls its upstream's
    models every 2 s)."""
    deadline = time.monotonic() + timeout
    with WeightServiceClient(address) as relay:
        while True:
            try:
                if relay.latest(MODEL, retry=False).version >= version:
                    return
            except ModelNotFound:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"relay {address} did not reach v{version} within {timeout:g}s")
            time.sleep(0.1)


def _egress_mib(rounds: list[dict[str, int]]) -> list[float]:
    return [sum(spent.values()) / MiB for spent in rounds]


def fanout_tree(repeats: int, transport: str) -> list[Row]:
    """The three configurations and the primary's egress; see the module docstring.
    `transport`: what the direct collectors (and the baseline) fetch with, as from another host."""
    rounds = max(repeats, MIN_ROUNDS)
    metrics_port = _free_port()
    weights = FlatPolicy(SIZE, 4, fill=0.0)
    relays: list[ServerProcess] = []
    primary_process = ServerProcess("--metrics-port", str(metrics_port), "--no-shm")  # (see the docstring)
    with primary_process as primary, WeightClient(primary.address) as client:
        egress = Egress(primary, metrics_port, MODEL)
        first = client.publish(weights, model=MODEL, **publish_kwargs(PUBLISH_TRANSPORT))
        file_bytes = client.describe(MODEL, first).byte_size
        collectors = RELAYS * PER_RELAY
        # The baseline and the direct configuration run with no relay following: relays would
        # take the cores from them on this machine, and add their own bytes to the egress.
        log(f"{ROW}: 1 collector direct ({transport}), {rounds} rounds")
        single = _measure(client, egress, weights, [primary.address], transport, rounds)
        try:
            for _ in range(RELAYS):
                relays.append(ServerProcess("--upstream", primary.address).start())
            for relay in relays:
                _wait_following(relay.address, client.latest(MODEL).version)
            log(
                f"{ROW}: {collectors} collectors via relays {', '.join(r.address for r in relays)} (auto), "
                f"{rounds} rounds"
            )
            tree_addresses = [relay.address for relay in relays for _ in range(PER_RELAY)]
            tree = _measure(client, egress, weights, tree_addresses, "auto", rounds)
        finally:
            for relay in relays:
                relay.stop(timeout=10)
        log(f"{ROW}: {collectors} collectors direct ({transport}), {rounds} rounds")
        direct = _measure(client, egress, weights, [primary.address] * collectors, transport, rounds)
    return _rows(single, tree, direct, transport, file_bytes)


def _rows(single: dict, tree: dict, direct: dict, transport: str, file_bytes: int) -> list[Row]:
    """The baseline, the two freshness rows and the egress row; `file_bytes`: the size of one
    version (the safetensors file: the tensors and their header)."""
    collectors = RELAYS * PER_RELAY
    base = Row("fanout_tree_single", SIZE, "ms", single["freshness_ms"], kind="baseline")
    base.note = (
        f"publish() call -> 1 byte-level collector fetching directly from the primary (transport={transport}) "
        f"has the version; fetched via {'/'.join(single['transports'])}"
    )
    base.extra = single
    base_ms = statistics.median(single["freshness_ms"])

    def freshness_row(name: str, measured: dict, how: str) -> Row:
        row = Row(name, SIZE, "ms", measured["freshness_ms"])
        p50, p99 = percentile(row.samples, 50), percentile(row.samples, 99)
        row.baseline, row.baseline_value = f"fanout_tree_single {format_size(SIZE)}", base_ms
        egress = statistics.median(_egress_mib(measured["egress"]))
        row.note = (
            f"publish() call -> last of {collectors} byte-level collectors (WeightServiceClient threads, 8 per "
            f"process, no torch; each fetches every committed version announced on its Watch, checked against "
            f"its xxh3) {how}; p50 {p50:.1f} ms ({p50 / base_ms:.2f}x), p99 {p99:.1f} ms ({p99 / base_ms:.2f}x) "
            f"of the single collector's median; primary egress {egress:.1f} MiB per version (median); fetched via "
            f"{'/'.join(measured['transports'])}; publish() returned after "
            f"{statistics.median(measured['publish_returned_ms']):.1f} ms (median, {PUBLISH_TRANSPORT})"
        )
        if measured["wrong_digests"]:
            row.note += f"; WRONG DIGEST in {measured['wrong_digests']} fetches"
        row.extra = {
            **measured,
            "p50_ms": p50,
            "p99_ms": p99,
            "single_median_ms": base_ms,
            "model_bytes": SIZE,
            "file_bytes": file_bytes,
            "relays": RELAYS if name == ROW else 0,
            "collectors": collectors,
        }
        return row

    tree_row = freshness_row(ROW, tree, f"from {RELAYS} relays ({PER_RELAY} each, transport=auto)")
    tree_row.judge(tree_row.extra["p99_ms"] / base_ms, "<=", TREE_TARGET, f"p99 ratio <= {TREE_TARGET:g}x")
    direct_row = freshness_row("fanout_tree_direct", direct, f"directly from the primary (transport={transport})")
    direct_row.ratio = direct_row.extra["p99_ms"] / base_ms
    direct_row.target = "none (reported; p99 ratio)"

    per_version = _egress_mib(tree["egress"])
    egress_row = Row("fanout_tree_egress", SIZE, "MiB", per_version)
    egress_row.baseline, egress_row.baseline_value = "one version's file", file_bytes / MiB
    egress_row.judge(max(per_version) * MiB / file_bytes, "<=", EGRESS_TARGET, f"worst ratio <= {EGRESS_TARGET:g}x")
    if min(per_version) * MiB < file_bytes:  # the relays got a version without the primary sending it whole
        egress_row.passed = False
    by_kind = {key: statistics.median(r.get(key, 0) for r in tree["egress"]) / MiB for key in tree["egress"][0]}
    direct_egress = statistics.median(_egress_mib(direct["egress"]))
    egress_row.note = (
        f"the primary's payload bytes per version with {RELAYS} relays and {collectors} collectors (its "
        f"weightserver_fetch_bytes_total over every transport + its log's fetch_incoming bytes, cut-through; "
        f"Watch and other control messages not counted); median by kind "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items()))
        + f" MiB; ratio = worst version / one version's file ({file_bytes} bytes; less than one file for a version "
        f"FAILS: the relays' bytes went uncounted); the same {collectors} "
        f"collectors directly: "
        f"{direct_egress:.1f} MiB per version ({direct_egress * MiB / file_bytes:.1f}x)"
    )
    egress_row.extra = {
        "per_version": tree["egress"],
        "direct_per_version": direct["egress"],
        "model_bytes": SIZE,
        "file_bytes": file_bytes,
    }
    return [base, tree_row, direct_row, egress_row]
