"""`freshness_link`: publish call -> 2 collectors applied, over a real (shaped) link.

On a `bench.link.Link` of 4 hosts, each in a network namespace of its own ("trainer",
"server", "collector0", "collector1"; `tbf` at 1 Gb/s or 10 Gb/s per direction, `netem` 0.2 ms
one way where the kernel has it): the trainer process starts the server (`weightserver serve
--host <server's address> --no-shm`, through `ip netns exec`) and publishes over bulk; each
collector (`bench.workers.freshness_collector`, the freshness rows' own) follows the server's
address with `GrpcLocalWeightUpdater(watch=True, transport="bulk")`. Timed as
`freshness_remote` (`bench.freshness.timed_publishes`): the trainer's `time.monotonic()` just
before `publish()` -> the later collector's stamp once its policy holds the version
(CLOCK_MONOTONIC is one clock for every process on the host, whatever its namespace).
Judged against `raw_fanout` measured on the same link, right before: <= 1.3x.

What the trainer publishes is a `LinkWorkload` (default: `FlatWorkload`, the freshness rows'
4 float32 tensors marked at both ends), and the collectors' updater takes `collector_options`:
`freshness_on_link(link, size, repeats, workload=..., collector_options={...})` is the entry
point for other traces (a bf16 language model's state dicts, deltas on or off).
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from bench import link as link_harness
from bench import workers
from bench.common import Row, format_size, log, not_available
from bench.raw_fanout import raw_fanout
from bench.rows import compare
from weightserver.process import ServerProcess

SPAWN = multiprocessing.get_context("spawn")
ROW = "freshness_link"
RATES = ("1gbit", "10gbit")
DELAY_MS = 0.2
COLLECTORS = 2
TARGET = 1.3  # x raw_fanout on the same link
HOSTS = ["trainer", "server", *(f"collector{i}" for i in range(COLLECTORS))]
REPLY_TIMEOUT = 300.0


def names(rates: tuple[str, ...] = RATES) -> list[str]:
    """The rows and baselines this module makes, in table order."""
    return [f"{kind}_{rate}" for rate in rates for kind in ("raw_fanout", ROW)]


class LinkWorkload(Protocol):
    """What the trainer publishes, version after version. Pickled to the trainer's process
    and built there (`prepare`), so a model-sized state never crosses a pipe."""

    def shapes(self) -> Any:
        """The collectors' live policy, as their `collector` target takes it
        (`freshness_collector`: the parameter lengths of a float32 FlatPolicy)."""

    def prepare(self, step: int) -> float | None:
        """Untimed: make the state of `step` (negative: the version collectors start from).
        Returns the value every parameter holds at both ends in it, which each collector's
        policy is checked against, or None (not checked)."""

    def state(self) -> torch.nn.Module | Mapping[str, torch.Tensor]:
        """What `WeightClient.publish` gets for the prepared step."""


class FlatWorkload:
    """The freshness rows' workload: a FlatPolicy of 4 float32 tensors totalling `size`
    bytes; step i writes float(i) at both ends of every tensor (every version differs in
    every tensor)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._policy: Any = None

    def shapes(self) -> list[int]:
        """FlatPolicy(size, 4).shapes() without allocating it."""
        base, extra = divmod(self.size // 4, 4)
        return [base + (1 if i < extra else 0) for i in range(4)]

    def prepare(self, step: int) -> float:
        from bench.freshness import _mark
        from bench.models import FlatPolicy

        if self._policy is None:
            self._policy = FlatPolicy(self.size, 4, fill=0.0)
        value = float(step) if step >= 0 else -100.0
        _mark(self._policy, value)
        return value

    def state(self) -> torch.nn.Module:
        return self._policy


class NamespacedServer(ServerProcess):
    """`weightserver serve` bound to `host` in network namespace `netns` (started through `ip
    netns exec`); `address` is `host:port`, so the health check and the clients dial it there."""

    def __init__(self, host: str, netns: str, *args: str) -> None:
        super().__init__("--host", host, *args, prefix=["ip", "netns", "exec", netns])
        self.host = host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def link_trainer(
    host: str, netns: str, workload: LinkWorkload, model: str, transport: str, commands: Any, results: Any
) -> None:
    """The trainer, in its own namespace: starts the server in `netns` on `host` (its health
    check crosses the link), publishes the first version, puts ("ready", address), then for
    each step from `commands` (None ends) prepares it, idles PUBLISH_GAP_SECONDS, publishes
    and puts ("published", version, monotonic at the call, at the return, expected value).
    Last ("done", {version: transport that carried the publish}) from the server's log."""
    from bench.freshness import PUBLISH_GAP_SECONDS, publish_kwargs, server_publish_transports
    from weightclient import WeightClient

    torch.set_num_threads(1)
    no_shm = () if transport == "shm" else ("--no-shm",)  # shared memory only for a trainer on the server's host
    with NamespacedServer(host, netns, *no_shm) as server, WeightClient(server.address) as client:
        kwargs = publish_kwargs(transport)
        workload.prepare(-1)
        client.publish(workload.state(), model=model, **kwargs)
        results.put(("ready", server.address))
        while (step := commands.get()) is not None:
            expected = workload.prepare(step)
            time.sleep(PUBLISH_GAP_SECONDS)
            called = time.monotonic()
            version = client.publish(workload.state(), model=model, **kwargs)
            results.put(("published", version, called, time.monotonic(), expected))
        results.put(("done", server_publish_transports(server.log(), model)))


class _Trainer:
    """The `link_trainer` process, started in the namespace of the link's host `where`."""

    def __init__(
        self, link: link_harness.Link, workload: LinkWorkload, model: str, transport: str, where: str = "trainer"
    ) -> None:
        self.commands, self.results = SPAWN.Queue(), SPAWN.Queue()
        args = (link.address("server"), link.netns("server"), workload, model, transport, self.commands, self.results)
        self.process = SPAWN.Process(target=link_trainer, args=args, daemon=True, name="bench-link-trainer")
        with link.spawning_in(where):
            self.process.start()

    def reply(self, kind: str) -> tuple:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            try:
                message = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the trainer exited with {self.process.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no '{kind}' from the trainer in {REPLY_TIMEOUT:g} s") from None
                continue
            if message[0] != kind:
                raise RuntimeError(f"the trainer said {message[0]!r}, expected {kind!r}")
            return message

    def publish(self, step: int) -> tuple[int, float, float, float | None]:
        self.commands.put(step)
        _, version, called, returned, expected = self.reply("published")
        return version, called, returned, expected

    def finish(self) -> dict[int, str]:
        self.commands.put(None)
        carried = self.reply("done")[1]
        self.process.join(30)
        return carried

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(None)
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def freshness_on_link(
    link: link_harness.Link,
    size: int,
    repeats: int,
    *,
    workload: LinkWorkload | None = None,
    collector_options: Mapping[str, Any] | None = None,
    collector: Callable[..., None] = workers.freshness_collector,
    transport: str = "bulk",
    name: str = ROW,
    trainer_host: str = "trainer",
    publish_transport: str | None = None,
) -> Row:
    """Freshness in ms on `link` (hosts `HOSTS`): the trainer publishes `workload` (default
    `FlatWorkload(size)`) over `transport`, `COLLECTORS` collector processes (`collector`,
    with updater keyword arguments `collector_options`, e.g. deltas on or off) apply each
    version; see `bench.freshness.timed_publishes`. Not judged: the caller compares."""
    from bench.freshness import Collectors, timed_publishes

    workload = workload or FlatWorkload(size)
    model = f"{name}-{format_size(size)}"
    publish_transport = publish_transport or transport
    trainer = _Trainer(link, workload, model, publish_transport, trainer_host)
    try:
        address = trainer.reply("ready")[1]
        log(f"{name} {format_size(size)}: server on {address}, starting {COLLECTORS} collectors ({transport})")
        group = Collectors(
            COLLECTORS,
            address,
            model,
            workload.shapes(),
            transport,
            target=collector,
            options=collector_options,
            spawn_in=lambda i: link.spawning_in(f"collector{i}"),
        )
        with group:
            timed = timed_publishes(group, repeats, trainer.publish)
        carried = set(trainer.finish().values())
    finally:
        trainer.close()
    row = Row(name, size, "ms", timed.samples)
    applications = COLLECTORS * repeats
    row.note = (
        f"publish(transport={publish_transport}) call in the {trainer_host}'s namespace -> {COLLECTORS} collectors "
        "in theirs applied "
        f"({link.describe()}); fetched via {'/'.join(sorted(timed.used))}, {timed.early} of {applications} "
        f"received before the commit; published via {'/'.join(sorted(carried or {'unknown'}))}; publish() returned "
        f"after {statistics.median(timed.publish_ms):.1f} ms (median)"
    )
    if timed.used != {transport} or carried != {publish_transport}:
        row.note += f"; NOT all {transport} (fetches) and {publish_transport} (publishes)"
    if timed.wrong:
        row.note += f"; WRONG WEIGHTS in {timed.wrong} applications"
    row.extra = {
        "link": link.describe(),
        "rate": link.rate,
        "delay_ms": link.delay_ms,
        "delay_applied": link.delay_applied,
        "publish_returned_ms": timed.publish_ms,
        "per_collector_ms": timed.per_collector,
        "fetch_transports": sorted(timed.used),
        "publish_transports": sorted(carried),
        "wrong_weights": timed.wrong,
        "received_before_commit": timed.early,
        "collector_options": dict(collector_options or {}),
    }
    return row


def freshness_link(sizes: list[int], repeats: int, rates: tuple[str, ...] = RATES) -> list[Row]:
    """Per rate, one link: per size `raw_fanout_<rate>` (the baseline, on that link) then
    `freshness_link_<rate>`, judged <= 1.3x against it."""
    why = link_harness.available()
    if why:
        return [not_available(n, s, "ms", f"ratio <= {TARGET:g}x", why) for s in sizes for n in names(rates)]
    rows: list[Row] = []
    for rate in rates:
        with link_harness.Link(HOSTS, rate=rate, delay_ms=DELAY_MS) as link:
            for size in sizes:
                base = raw_fanout(size, repeats, link=link, receivers=COLLECTORS, name=f"raw_fanout_{rate}")
                row = freshness_on_link(link, size, repeats, name=f"{ROW}_{rate}")
                rows += [base, compare(row, base, "<=", TARGET, time_based=True)]
    return rows


class LMTraceWorkload:
    """Trace (b) of `bench.traces`: a Llama (`config`, 134M parameters by default) trained with
    AdamW on fp32 master weights at lr 1e-6; each step publishes its bf16 cast. `prepare` runs
    the step (untimed); the collectors build the same model in bf16 (`shapes`)."""

    def __init__(self, config: str = "llama-134m") -> None:
        self.config = config
        self._steps: Any = None
        self._state: Any = None

    def shapes(self) -> dict[str, str]:
        return {"lm_config": self.config}

    def prepare(self, step: int) -> None:
        from bench.traces import lm_trace

        if self._steps is None:
            self._steps = lm_trace(1 << 30, config=self.config)  # as many steps as asked for
        self._state = next(self._steps)
        return None  # each collector's updater checks every version against its xxh3

    def state(self) -> Mapping[str, torch.Tensor]:
        return self._state


LM_ROW = "freshness_link_lm"
LM_RATE = "1gbit"
LM_TARGET = 0.1  # deltas at least 10x fresher than whole versions (issue 31)


def freshness_link_lm(repeats: int, config: str = "llama-134m") -> list[Row]:
    """Trace (b) on a 1 Gb/s link: the trainer beside the server (its namespace), 2 collectors
    behind the link; whole versions (`delta=False`, cut-through on) against element deltas
    (`incoming=False`: a collector that received a version's bytes as they arrived could not
    take a delta), judged: the deltas' freshness <= 0.1x the whole versions'."""
    why = link_harness.available()
    names = [f"{LM_ROW}_full", f"{LM_ROW}_delta"]
    if why:
        return [not_available(n, None, "ms", f"ratio <= {LM_TARGET:g}x", why) for n in names]
    rows = []
    with link_harness.Link(HOSTS, rate=LM_RATE, delay_ms=DELAY_MS) as link:
        # The updater's defaults otherwise (update_timeout bounds each wait for bytes, not the transfer)
        choices = ({"delta": False}, {"incoming": False})
        for name, options in zip(names, choices, strict=True):
            workload = LMTraceWorkload(config)
            rows.append(
                freshness_on_link(
                    link,
                    0,
                    repeats,
                    workload=workload,
                    collector_options=options,
                    name=name,
                    trainer_host="server",
                    publish_transport="shm",  # the trainer beside the server; the collectors fetch over bulk
                )
            )
    full, delta = rows
    delta.baseline, delta.baseline_value = full.name, full.median
    return [
        full.judge(None, "<=", 1.0, "none (the baseline)"),
        delta.judge(delta.median / full.median, "<=", LM_TARGET),
    ]
