"""Soak test: many watchers, fetchers and a steady publisher against one real server, for minutes.

    .venv/bin/python bench/soak.py [--seconds 600] [--watchers 64] [--fetchers 8]
                                   [--publish-interval 1.0] [--model-bytes 4MiB] [--json FILE]

A `weightserver serve` child process (weightserver.process.ServerProcess) serves:

* a publisher (one WeightClient) publishing a changed model every `--publish-interval` s;
* `--watchers` Watch streams (threads, spread over `--watch-channels` shared WeightClients),
  each recording every event it receives;
* `--fetchers` fetcher threads (one WeightClient each, transports cycling through
  `--transports`), fetching in a loop: mostly the latest version, and in turn
  `fetch(newer_than=last seen)`, a delta `fetch(base=previous result)` and `latest()` followed
  by `fetch(version=...)`; every result's tensors are checked against what the publisher
  published under that version;
* a sampler reading the server's VmRSS, open fds, threads and shared-memory files every
  few seconds.

Progress goes to stderr every ~10 s; the summary to stdout. Exit 0 only when there were no
errors, every watcher saw every acknowledged version exactly once and in order, and the
server's RSS is flat (see RSS_RULE). `--json FILE` writes every sample and per-watcher record.

What counts as an error: a failed or out-of-order publish; any exception from a fetch except
VersionEvicted (a version named by an earlier reply, e.g. `latest()` then `fetch(version=...)`,
or the client's own re-fetch by number when a fast path fails, was evicted meanwhile): that is
retention at work, and the fetcher does what a collector would, it asks for the latest again
(counted as "evicted retries", by kind; VersionNotFound and ModelNotFound are errors); a fetched
version whose tensors or metadata differ from what was published under that number; a latest
fetch older than a version acknowledged before the call began (or older than one this fetcher
already saw); `newer_than` answering "up to date" although a newer version was acknowledged
before the call; a watch event with `gap` set, out of order or duplicated, or a watch stream
ending before shutdown; the server exiting, exiting non-zero on SIGTERM, or logging an ERROR
or a traceback; a thread that does not stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `bench` is a package

from bench.common import MB, format_size, log, parse_size, percentile, rss_bytes  # noqa: E402
from weightserver.protocol.errors import VersionEvicted  # noqa: E402

MODEL = "policy"
RSS_TOLERANCE_FRACTION = 0.10
RSS_TOLERANCE_BYTES = 20 * MB
RSS_RULE = (
    f"median RSS of the last third <= median RSS of the middle third x {1 + RSS_TOLERANCE_FRACTION:g} "
    f"+ {RSS_TOLERANCE_BYTES // MB} MB (the first third is warm-up)"
)
MAX_ERRORS_KEPT = 200
DRAIN_SECONDS = 15.0  # after the last publish, how long watchers get to catch up
JOIN_SECONDS = 10.0
_LOG_PROBLEM = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) |Traceback \(most recent call last\)")


# ---------------------------------------------------------------------- shared state
@dataclass
class SoakError:
    t: float  # seconds since the soak started
    source: str  # "publisher", "fetcher-3", "watcher-17", "server", ...
    message: str


class SoakState:
    """Everything the threads share: expected contents, acknowledged versions, errors."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.started = time.monotonic()
        self.stop = stop or threading.Event()  # publisher and fetchers stop (set early: interrupted)
        self.closing = threading.Event()  # watch streams are about to be closed on purpose
        self._lock = threading.Lock()
        self.errors: list[SoakError] = []
        self.error_count = 0
        self.expected: dict[int, dict[str, str]] = {}  # publish seq -> {tensor: xxh3-64}
        self.publish_started: dict[int, float] = {}  # seq -> monotonic time publish() was called
        self.acked: list[int] = []  # acknowledged versions, in acknowledgement order
        self.version_seq: dict[int, int] = {}  # acknowledged version -> seq
        self.acked_max = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def error(self, source: str, message: str) -> None:
        with self._lock:
            self.error_count += 1
            if len(self.errors) < MAX_ERRORS_KEPT:
                self.errors.append(SoakError(round(self.elapsed(), 3), source, message))
        log(f"ERROR {source}: {message}")

    def ack(self, version: int, seq: int) -> None:
        with self._lock:
            self.acked.append(version)
            self.version_seq[version] = seq
            self.acked_max = max(self.acked_max, version)


# ---------------------------------------------------------------------- publisher
class Publisher:
    """Publishes `model_bytes` of float32 weights (4 tensors) plus a step tensor, once per
    interval on a fixed schedule; each publish rewrites one big tensor (in turn) and the step.
    Before each publish the expected xxh3 of every tensor is recorded under a sequence number
    that travels in the version's metadata."""

    def __init__(self, address: str, state: SoakState, model_bytes: int, interval: float) -> None:
        import torch

        from weightclient import WeightClient

        self.state = state
        self.interval = interval
        self.client = WeightClient(address, client_id="soak-publisher")
        elements = max(1, model_bytes // 4 // 4)
        self.ramp = torch.arange(elements, dtype=torch.float32) * 1e-3
        self.weights = {f"w{k}": self.ramp.clone() for k in range(4)}
        self.weights["step"] = torch.zeros(1, dtype=torch.int64)
        self.seq = 0
        self.latencies: list[float] = []
        self.late = 0  # publishes that started more than one interval behind schedule
        self.thread = threading.Thread(target=self._run, name="soak-publisher", daemon=True)

    def publish_one(self) -> int | None:
        """Change the weights, publish, record the acknowledged version (None on failure)."""
        import torch

        self.seq += 1
        seq = self.seq
        torch.add(self.ramp, float(seq), out=self.weights[f"w{seq % 4}"])
        self.weights["step"].fill_(seq)
        self.state.expected[seq] = {name: _digest(t) for name, t in self.weights.items()}
        started = time.monotonic()
        self.state.publish_started[seq] = started
        version = self._send(seq)
        if version is None:
            return None
        self.latencies.append(time.monotonic() - started)
        if self.state.acked and version <= self.state.acked[-1]:
            self.state.error("publisher", f"publish seq {seq} got v{version}, not above v{self.state.acked[-1]}")
        self.state.ack(version, seq)
        return version

    def _send(self, seq: int) -> int | None:
        """Publish the current weights under `seq`; the version, or None (an error) on failure."""
        try:
            return self.client.publish(self.weights, model=MODEL, metadata={"seq": str(seq)}, timeout=30)
        except Exception as exc:
            self.state.error("publisher", f"publish seq {seq} failed: {type(exc).__name__}: {exc}")
            return None

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self.state.stop.is_set():
            self.publish_one()
            next_at += self.interval
            now = time.monotonic()
            if now > next_at + self.interval:
                self.late += 1
                next_at = now  # behind schedule: publish at once, do not try to catch up
            self.state.stop.wait(max(0.0, next_at - now))


def _digest(tensor: Any) -> str:
    import xxhash

    from weightclient.tensors import tensor_bytes

    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor.contiguous()))


# ---------------------------------------------------------------------- watchers
class Watcher:
    """One Watch stream (since=0) consumed in a thread; records (version, seq, gap, time)."""

    def __init__(self, index: int, client: Any, state: SoakState) -> None:
        self.index = index
        self.name = f"watcher-{index}"
        self.client = client
        self.state = state
        self.versions: list[int] = []
        self.delays: list[float] = []  # publish() called -> event received, seconds
        self.gaps = 0
        self.problems = 0  # out-of-order, duplicate, wrong seq
        self.ended = ""  # how the stream ended
        self.seen = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"soak-{self.name}", daemon=True)

    def last(self) -> int:
        return self.versions[-1] if self.versions else 0

    def _run(self) -> None:
        try:
            for event in self.client.watch(MODEL, since=0):
                self._on_event(event, time.monotonic())
            self.ended = "stream ended"
        except Exception as exc:
            self.ended = f"{type(exc).__name__}: {exc}"
        if not self.state.closing.is_set():
            self.state.error(self.name, f"watch stream ended before shutdown: {self.ended}")

    def _on_event(self, event: Any, received: float) -> None:
        """Check and record one event: in order, no duplicate, the seq the publisher got."""
        version = event.version
        if event.gap:
            self._on_gap(version)
        if self.versions and version <= self.versions[-1]:
            self.problems += 1
            self.state.error(self.name, f"v{version} after v{self.versions[-1]} (out of order or duplicate)")
        seq = int(event.info.metadata.get("seq", "-1"))
        started = self.state.publish_started.get(seq)
        if started is not None and seq > 1:  # v1 was published before the watchers started
            self.delays.append(received - started)
        known = self.state.version_seq.get(version)
        if known is not None and known != seq:
            self.problems += 1
            self.state.error(self.name, f"v{version} carries seq {seq}, the publisher got v{version} for {known}")
        with self.seen:
            self.versions.append(version)
            self.seen.notify_all()

    def _on_gap(self, version: int) -> None:
        """An event flagged `gap`: in a soak (no restarts, nobody slow enough) an error."""
        self.gaps += 1
        self.state.error(self.name, f"event v{version} reports a gap (versions missed for good)")

    def wait_for(self, version: int, timeout: float) -> bool:
        with self.seen:
            return self.seen.wait_for(lambda: self.last() >= version, timeout)


# ---------------------------------------------------------------------- fetchers
@dataclass
class FetchCounts:
    latest: int = 0
    newer_than: int = 0
    up_to_date: int = 0
    delta: int = 0
    describe_then_fetch: int = 0
    evicted_retries: int = 0
    evicted_by_kind: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    seconds: list[float] = field(default_factory=list)
    transports: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.latest + self.newer_than + self.delta + self.describe_then_fetch


class Fetcher:
    """Fetches in a loop (own WeightClient), checking each result against the publisher's
    record. Cycle of 10: newer_than at 3, a delta at 6, latest()+fetch(version) at 8, else
    the latest."""

    def __init__(
        self, index: int, address: str, state: SoakState, transport: str, pause: float, timeout: float = 30.0
    ) -> None:
        from weightclient import WeightClient

        self.index = index
        self.name = f"fetcher-{index}"
        self.state = state
        self.transport = transport
        self.pause = pause
        self.timeout = timeout  # of every call (fetch, latest)
        self.client = WeightClient(address, client_id=f"soak-{self.name}", timeout=timeout)
        self.counts = FetchCounts()
        self.last_version = 0
        self.base: Any = None  # the last complete FetchResult, for delta fetches
        self.thread = threading.Thread(target=self._run, name=f"soak-{self.name}", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.state.stop.is_set():
            kind = {3: "newer_than", 6: "delta", 8: "describe_then_fetch"}.get(n % 10, "latest")
            if kind == "delta" and self.base is None:
                kind = "latest"
            n += 1
            try:
                self._fetch(kind)
            except VersionEvicted:
                # Retention at work: ask for the latest again at once, as a collector would.
                self.counts.evicted_retries += 1
                self.counts.evicted_by_kind[kind] = self.counts.evicted_by_kind.get(kind, 0) + 1
                continue
            except Exception as exc:
                if self.state.stop.is_set() and self.state.closing.is_set():
                    break
                self._failed(kind, exc)
            if self.pause:
                self.state.stop.wait(self.pause)

    def _failed(self, kind: str, exc: Exception) -> None:
        self.counts.errors += 1
        self.state.error(self.name, f"{kind} fetch ({self.transport}): {type(exc).__name__}: {exc}")

    def _fetch(self, kind: str) -> None:
        acked_before = self.state.acked_max
        started = time.perf_counter()
        if kind == "newer_than":
            since = self.last_version
            result = self.client.fetch(MODEL, newer_than=since, transport=self.transport, timeout=self.timeout)
            self.counts.newer_than += 1
            if result is None:
                self.counts.up_to_date += 1
                if acked_before > since:
                    self.state.error(self.name, f"newer_than={since}: up to date, but v{acked_before} was acknowledged")
                return
            if result.version <= since:
                self.state.error(self.name, f"newer_than={since} returned v{result.version}")
        elif kind == "delta":
            result = self.client.fetch(MODEL, base=self.base, transport=self.transport, timeout=self.timeout)
            self.counts.delta += 1
        elif kind == "describe_then_fetch":
            info = self.client.latest(MODEL)
            # VersionEvicted here (evicted since latest()) is counted and retried by _run.
            result = self.client.fetch(MODEL, version=info.version, transport=self.transport, timeout=self.timeout)
            self.counts.describe_then_fetch += 1
        else:
            result = self.client.fetch(MODEL, transport=self.transport, timeout=self.timeout)
            self.counts.latest += 1
        self.counts.seconds.append(time.perf_counter() - started)
        if result.stats is not None:
            used = result.stats.transport
            self.counts.transports[used] = self.counts.transports.get(used, 0) + 1
        self._check(result, kind, acked_before)

    def _check(self, result: Any, kind: str, acked_before: int) -> None:
        version = result.version
        if kind != "newer_than" and version < acked_before:
            self.state.error(self.name, f"{kind} returned v{version}, older than acknowledged v{acked_before}")
        if version < self.last_version:
            self.state.error(self.name, f"{kind} returned v{version} after this fetcher saw v{self.last_version}")
        self.last_version = max(self.last_version, version)
        seq_text = result.metadata.get("seq")
        expected = self.state.expected.get(int(seq_text)) if seq_text and seq_text.isdigit() else None
        if expected is None:
            self.state.error(self.name, f"v{version} has metadata {result.metadata}, no such publish")
            return
        known = self.state.version_seq.get(version)
        if known is not None and str(known) != seq_text:
            self.state.error(self.name, f"v{version} carries seq {seq_text}, the publisher got v{version} for {known}")
        if result.partial:
            self.state.error(self.name, f"{kind} v{version}: a partial result from a complete base")
            return
        got = {name: _digest(t) for name, t in result.tensors.items()}
        if got != expected:
            wrong = sorted(n for n in expected.keys() | got.keys() if got.get(n) != expected.get(n))
            self.state.error(self.name, f"{kind} v{version} (seq {seq_text}): tensors {wrong} differ from published")
            return
        if not result.placed:
            self.base = result


# ---------------------------------------------------------------------- server sampling
@dataclass
class Sample:
    t: float
    server_rss: int
    server_fds: int
    server_threads: int
    shm_bytes: int
    client_rss: int
    published: int
    fetches: int
    errors: int


def _count_dir(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _shm_bytes(pid: int) -> int:
    """Bytes in this server's shared-memory directory (/dev/shm/weightserver-*-<pid>)."""
    total = 0
    root = Path("/dev/shm")
    for directory in root.glob(f"weightserver-*-{pid}"):
        for dirpath, _dirs, files in os.walk(directory):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
    return total


# ---------------------------------------------------------------------- the soak
@dataclass
class SoakConfig:
    seconds: float = 600.0
    watchers: int = 64
    fetchers: int = 8
    publish_interval: float = 1.0
    model_bytes: int = 4 << 20
    watch_channels: int = 8
    transports: tuple[str, ...] = ("auto", "bulk", "stream")
    fetch_pause: float = 0.02
    sample_interval: float = 0.0  # 0: seconds / 60, between 0.5 and 5
    progress_interval: float = 10.0
    keep: int | None = None  # server --keep (None: the server's default)
    server_args: tuple[str, ...] = ()


@dataclass
class SoakResult:
    config: dict[str, Any]
    duration: float = 0.0
    interrupted: bool = False
    published: int = 0
    acked_versions: list[int] = field(default_factory=list)
    publish_latency: dict[str, float] = field(default_factory=dict)
    late_publishes: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    watchers: list[dict[str, Any]] = field(default_factory=list)
    watchers_missing: int = 0
    watch_delay: dict[str, float] = field(default_factory=dict)
    fetchers: list[dict[str, Any]] = field(default_factory=list)
    fetches: int = 0
    fetch_errors: int = 0
    evicted_retries: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)
    rss: dict[str, Any] = field(default_factory=dict)
    leak_watch: dict[str, Any] = field(default_factory=dict)
    server_exit_code: int | None = None
    server_log_problems: list[str] = field(default_factory=list)
    server_log_warnings: int = 0
    ok: bool = False

    @property
    def rss_flat(self) -> bool:
        return bool(self.rss.get("flat"))


def run_soak(
    config: SoakConfig, on_progress: Callable[[str], None] = log, stop: threading.Event | None = None
) -> SoakResult:
    """Run one soak against a fresh server process; return what happened (see SoakResult.ok).

    Setting `stop` (e.g. from a SIGINT handler) ends the soak early; it then shuts down as
    usual and the result is marked interrupted."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the publisher's tensor ops are tiny; leave the cores to the rest
    try:
        return _run_soak(config, on_progress, stop)
    finally:
        torch.set_num_threads(threads)


def _run_soak(config: SoakConfig, on_progress: Callable[[str], None], stop: threading.Event | None) -> SoakResult:
    from weightclient import WeightClient
    from weightserver.process import ServerProcess

    sample_every = config.sample_interval or min(5.0, max(0.5, config.seconds / 60))
    server_args = list(config.server_args)
    if config.keep is not None:
        server_args += ["--keep", str(config.keep)]
    result = SoakResult(config=asdict(config))
    state = SoakState(stop)
    samples: list[Sample] = []
    publisher: Publisher | None = None
    watchers: list[Watcher] = []
    fetchers: list[Fetcher] = []
    watch_clients: list[Any] = []
    server = ServerProcess(*server_args)
    server.start()
    pid = server.process.pid if server.process else 0
    on_progress(f"soak: server pid {pid} on {server.address}, log {server.log_path}")

    def sample() -> Sample:
        s = Sample(
            t=round(state.elapsed(), 3),
            server_rss=rss_bytes(pid),
            server_fds=_count_dir(f"/proc/{pid}/fd"),
            server_threads=_threads(pid),
            shm_bytes=_shm_bytes(pid),
            client_rss=rss_bytes(),
            published=len(state.acked),
            fetches=sum(f.counts.total for f in fetchers),
            errors=state.error_count,
        )
        samples.append(s)
        return s

    try:
        # Version 1 first: every watcher (since=0) gets it from the backlog, which proves its
        # subscription is live before the publisher starts (the server subscribes, then reads
        # the backlog).
        publisher = Publisher(server.address, state, config.model_bytes, config.publish_interval)
        if publisher.publish_one() is None:
            raise RuntimeError("the first publish failed")
        watch_clients = [
            WeightClient(server.address, client_id=f"soak-watch-channel-{i}")
            for i in range(max(1, min(config.watch_channels, config.watchers)))
        ]
        watchers = [Watcher(i, watch_clients[i % len(watch_clients)], state) for i in range(config.watchers)]
        for watcher in watchers:
            watcher.thread.start()
        deadline = time.monotonic() + 60
        for watcher in watchers:
            if not watcher.wait_for(state.acked[0], max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{watcher.name} did not receive v{state.acked[0]} within 60 s")
        on_progress(f"soak: {len(watchers)} watchers subscribed; publishing and fetching for {config.seconds:g}s")
        state.started = time.monotonic()  # the soak proper starts now
        sample()
        fetchers = [
            Fetcher(i, server.address, state, config.transports[i % len(config.transports)], config.fetch_pause)
            for i in range(config.fetchers)
        ]
        for fetcher in fetchers:
            fetcher.thread.start()
        publisher.thread.start()

        end = state.started + config.seconds
        next_sample = state.started + sample_every
        next_progress = state.started + config.progress_interval
        while not state.stop.is_set():
            now = time.monotonic()
            if now >= end:
                break
            if server.process is not None and server.process.poll() is not None:
                state.error("server", f"the server exited with {server.process.returncode}")
                break
            if now >= next_sample:
                next_sample += sample_every
                s = sample()
                if now >= next_progress:
                    next_progress += config.progress_interval
                    on_progress(_progress_line(s, watchers))
            state.stop.wait(max(0.01, min(next_sample, end) - time.monotonic()))
        if state.stop.is_set():
            # Interrupted (Ctrl-C also reaches the server, which is in our process group):
            # what fails from here on is the shutdown, not the server.
            result.interrupted = True
            state.closing.set()
        result.duration = state.elapsed()

        # Shutdown: stop the publisher, let the watchers catch up with the last version, stop
        # the fetchers, then close the watch channels (which cancels the streams).
        state.stop.set()
        publisher.thread.join(JOIN_SECONDS + 30)
        sample()
        final = state.acked_max
        drain_until = time.monotonic() + DRAIN_SECONDS
        for watcher in watchers:
            watcher.wait_for(final, max(0.0, drain_until - time.monotonic()))
        for fetcher in fetchers:
            fetcher.thread.join(JOIN_SECONDS)
        state.closing.set()
    finally:
        state.stop.set()
        state.closing.set()
        for client in watch_clients:
            client.close()
        for watcher in watchers:
            watcher.thread.join(JOIN_SECONDS)
        for fetcher in fetchers:
            fetcher.thread.join(JOIN_SECONDS)
            fetcher.client.close()
        if publisher is not None:
            if publisher.thread.ident is not None:
                publisher.thread.join(JOIN_SECONDS)
            publisher.client.close()
        try:
            result.server_exit_code = server.stop(timeout=30)
        except Exception:
            server.kill()
            result.server_exit_code = None
        server_log = server.log()

    for thread in [w.thread for w in watchers] + [f.thread for f in fetchers]:
        if thread.is_alive():
            state.error("shutdown", f"thread {thread.name} did not stop")
    if publisher is not None and publisher.thread.is_alive():
        state.error("shutdown", "the publisher thread did not stop")
    if result.server_exit_code != 0:
        state.error("server", f"exit code {result.server_exit_code} after SIGTERM (expected 0)")
    for line in server_log.splitlines():
        match = _LOG_PROBLEM.search(line)
        if not match:
            continue
        if match.group(1) == "WARNING":
            result.server_log_warnings += 1
            if len(result.server_log_problems) < 20:
                result.server_log_problems.append(line)
        else:
            state.error("server-log", line)
            if len(result.server_log_problems) < 20:
                result.server_log_problems.append(line)

    _summarise(result, state, publisher, watchers, fetchers, samples)
    return result


def _progress_line(s: Sample, watchers: list[Watcher]) -> str:
    lasts = [w.last() for w in watchers] or [0]
    return (
        f"soak t={s.t:5.0f}s published={s.published} errors={s.errors} fetches={s.fetches} "
        f"watchers at v{min(lasts)}..v{max(lasts)} server RSS={s.server_rss / MB:.1f}MB "
        f"fds={s.server_fds} threads={s.server_threads} shm={s.shm_bytes / MB:.1f}MB "
        f"client RSS={s.client_rss / MB:.0f}MB"
    )


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def _thirds(samples: list[Sample], key: str) -> tuple[list[int], list[int]]:
    """Values of `key` in the middle and the last third of the run (by time)."""
    if not samples:
        return [], []
    span = samples[-1].t
    middle = [getattr(s, key) for s in samples if span / 3 <= s.t < 2 * span / 3]
    last = [getattr(s, key) for s in samples if s.t >= 2 * span / 3]
    return middle, last


def _slope_per_minute(samples: list[Sample], key: str) -> float | None:
    """Least-squares slope of `key` over the samples after warm-up (first third), per minute."""
    if not samples:
        return None
    span = samples[-1].t
    points = [(s.t, getattr(s, key)) for s in samples if s.t >= span / 3]
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    denominator = sum((t - mean_t) ** 2 for t, _ in points)
    if denominator == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / denominator * 60


def _summarise(
    result: SoakResult,
    state: SoakState,
    publisher: Publisher | None,
    watchers: list[Watcher],
    fetchers: list[Fetcher],
    samples: list[Sample],
) -> None:
    acked = sorted(state.acked)
    result.acked_versions = acked
    result.published = len(acked)
    if publisher is not None:
        result.publish_latency = _stats(publisher.latencies)
        result.late_publishes = publisher.late
    acked_set = set(acked)
    all_delays: list[float] = []
    for watcher in watchers:
        seen = watcher.versions
        missed = sorted(acked_set - set(seen))
        unexpected = sorted(set(seen) - acked_set)
        exact = seen == acked
        if missed:
            state.error(watcher.name, f"missed {len(missed)} version(s): {_ranges(missed)}")
        if unexpected:
            state.error(watcher.name, f"saw versions never acknowledged: {_ranges(unexpected)}")
        if not exact and not missed and not unexpected:
            state.error(watcher.name, "saw every version, but not exactly once in order")
        all_delays.extend(watcher.delays)
        result.watchers.append(
            {
                "name": watcher.name,
                "seen": len(seen),
                "first": seen[0] if seen else None,
                "last": seen[-1] if seen else None,
                "missed": missed,
                "unexpected": unexpected,
                "gaps": watcher.gaps,
                "exact": exact,
                "ended": watcher.ended,
                "versions": seen,
                "delay": _stats(watcher.delays),
            }
        )
    result.watchers_missing = sum(1 for w in result.watchers if not w["exact"])
    result.watch_delay = _stats(all_delays)
    for fetcher in fetchers:
        counts = fetcher.counts
        result.fetchers.append(
            {
                "name": fetcher.name,
                "transport": fetcher.transport,
                "fetches": counts.total,
                "latest": counts.latest,
                "newer_than": counts.newer_than,
                "up_to_date": counts.up_to_date,
                "delta": counts.delta,
                "describe_then_fetch": counts.describe_then_fetch,
                "evicted_retries": counts.evicted_retries,
                "evicted_by_kind": counts.evicted_by_kind,
                "errors": counts.errors,
                "transports_used": counts.transports,
                "seconds": _stats(counts.seconds),
            }
        )
    result.fetches = sum(f["fetches"] for f in result.fetchers)
    result.fetch_errors = sum(f["errors"] for f in result.fetchers)
    result.evicted_retries = sum(f["evicted_retries"] for f in result.fetchers)
    result.samples = [asdict(s) for s in samples]

    rss = [s.server_rss for s in samples]
    middle, last = _thirds(samples, "server_rss")
    rss_info: dict[str, Any] = {"rule": RSS_RULE}
    if rss:
        after_warmup = next((s.server_rss for s in samples if s.t >= samples[-1].t / 3), rss[-1])
        rss_info.update(start=rss[0], after_warmup=after_warmup, end=rss[-1], max=max(rss))
    if middle and last:
        limit = statistics.median(middle) * (1 + RSS_TOLERANCE_FRACTION) + RSS_TOLERANCE_BYTES
        rss_info.update(
            middle_median=statistics.median(middle),
            last_median=statistics.median(last),
            limit=limit,
            flat=statistics.median(last) <= limit,
            slope_bytes_per_minute=_slope_per_minute(samples, "server_rss"),
        )
    else:
        rss_info.update(flat=False, note="too few samples to judge")
    result.rss = rss_info
    for key in ("server_fds", "server_threads", "shm_bytes", "client_rss"):
        middle, last = _thirds(samples, key)
        result.leak_watch[key] = {
            "start": getattr(samples[0], key) if samples else None,
            "end": getattr(samples[-1], key) if samples else None,
            "max": max(getattr(s, key) for s in samples) if samples else None,
            "middle_median": statistics.median(middle) if middle else None,
            "last_median": statistics.median(last) if last else None,
        }
    result.error_count = state.error_count
    result.errors = [asdict(e) for e in state.errors]
    result.ok = not result.interrupted and result.error_count == 0 and result.watchers_missing == 0 and result.rss_flat


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> 'v1-v3, v7' (first 10 ranges)."""
    ranges: list[list[int]] = []
    for value in values:
        if ranges and value == ranges[-1][1] + 1:
            ranges[-1][1] = value
        else:
            ranges.append([value, value])
    text = [f"v{a}" if a == b else f"v{a}-v{b}" for a, b in ranges[:10]]
    more = f" (+{len(ranges) - 10} more)" if len(ranges) > 10 else ""
    return ", ".join(text) + more


# ---------------------------------------------------------------------- report
def format_summary(result: SoakResult) -> str:
    c = result.config
    rows: list[tuple[str, str]] = []

    def row(name: str, value: str) -> None:
        rows.append((name, value))

    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value / MB:.1f} MB"

    def ms(stats: dict[str, float]) -> str:
        if not stats:
            return "-"
        return f"p50 {stats['p50'] * 1e3:.1f} ms, p99 {stats['p99'] * 1e3:.1f} ms, max {stats['max'] * 1e3:.1f} ms"

    row(
        "setup",
        f"{c['watchers']} watchers on {min(c['watch_channels'], c['watchers'])} channels, {c['fetchers']} fetchers "
        f"({', '.join(c['transports'])}), publish every {c['publish_interval']:g}s, "
        f"model {format_size(c['model_bytes'])}",
    )
    row("duration", f"{result.duration:.1f} s" + (" (interrupted)" if result.interrupted else ""))
    acked = result.acked_versions
    row("versions published", f"{result.published}" + (f" (v{acked[0]}..v{acked[-1]})" if acked else ""))
    row("publish latency", ms(result.publish_latency) + f"; {result.late_publishes} behind schedule")
    row("errors", f"{result.error_count}" + ("" if result.error_count == 0 else "  <-- must be 0"))
    seen = [w["seen"] for w in result.watchers]
    if seen:
        row("watcher versions seen", f"min {min(seen)}, max {max(seen)} (of {result.published})")
    row(
        "watchers missing any",
        f"{result.watchers_missing} of {len(result.watchers)}" + ("  <-- must be 0" if result.watchers_missing else ""),
    )
    row("watch delay", ms(result.watch_delay) + " (publish() called -> event)")
    used: dict[str, dict[str, int]] = {}  # asked for -> what carried the fetches
    evicted: dict[str, int] = {}
    for f in result.fetchers:
        for name, count in f["transports_used"].items():
            used.setdefault(f["transport"], {})
            used[f["transport"]][name] = used[f["transport"]].get(name, 0) + count
        for kind, count in f["evicted_by_kind"].items():
            evicted[kind] = evicted.get(kind, 0) + count
    kinds = {k: sum(f[k] for f in result.fetchers) for k in ("latest", "newer_than", "delta", "describe_then_fetch")}
    up_to_date = sum(f["up_to_date"] for f in result.fetchers)
    row("fetches", f"{result.fetches} ({', '.join(f'{k} {v}' for k, v in kinds.items())}; up-to-date {up_to_date})")
    row(
        "fetch transports",
        "; ".join(
            f"{asked} -> " + ", ".join(f"{k} {v}" for k, v in sorted(carried.items()))
            for asked, carried in sorted(used.items())
        )
        or "-",
    )
    all_seconds = [f["seconds"] for f in result.fetchers if f["seconds"]]
    if all_seconds:
        row("fetch time (worst fetcher)", ms(max(all_seconds, key=lambda s: s["p99"])))
    row(
        "fetch errors",
        f"{result.fetch_errors}; evicted retries (not errors) {result.evicted_retries}"
        + (f" ({', '.join(f'{k} {v}' for k, v in sorted(evicted.items()))})" if evicted else ""),
    )
    r = result.rss
    row("server RSS start", mb(r.get("start")))
    row("server RSS after warm-up", mb(r.get("after_warmup")))
    row("server RSS end", mb(r.get("end")))
    row("server RSS max", mb(r.get("max")))
    if "middle_median" in r:
        slope = r.get("slope_bytes_per_minute")
        row(
            "RSS medians middle/last third",
            f"{mb(r['middle_median'])} / {mb(r['last_median'])} (limit {mb(r['limit'])})"
            + ("" if slope is None else f"; trend {slope / MB:+.2f} MB/min"),
        )
    row("RSS verdict", ("FLAT" if result.rss_flat else "NOT FLAT") + f": {r.get('rule', '')}")
    lw = result.leak_watch
    if lw.get("server_fds", {}).get("start") is not None:
        row(
            "server fds / threads",
            f"fds {lw['server_fds']['start']} -> {lw['server_fds']['end']} (max {lw['server_fds']['max']}), "
            f"threads {lw['server_threads']['start']} -> {lw['server_threads']['end']} "
            f"(max {lw['server_threads']['max']})",
        )
        row(
            "server shm files",
            f"{mb(lw['shm_bytes']['start'])} -> {mb(lw['shm_bytes']['end'])} (max {mb(lw['shm_bytes']['max'])})",
        )
        row("soak process RSS", f"{mb(lw['client_rss']['start'])} -> {mb(lw['client_rss']['end'])}")
    row("server exit code", str(result.server_exit_code))
    row("server log", f"{result.server_log_warnings} warnings, {len(result.server_log_problems)} lines kept")
    row("result", "PASS" if result.ok else "INTERRUPTED" if result.interrupted else "FAIL")

    width = max(len(name) for name, _ in rows)
    lines = ["", "soak summary", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    if result.errors:
        lines += ["", f"errors ({result.error_count}, first {len(result.errors)}):"]
        lines += [f"  [{e['t']:8.2f}s] {e['source']}: {e['message']}" for e in result.errors]
    if result.server_log_problems:
        lines += ["", "server log warnings/errors (first 20):"] + [f"  {line}" for line in result.server_log_problems]
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="soak duration (default: 600)")
    parser.add_argument("--watchers", type=int, default=64, help="concurrent Watch streams (default: 64)")
    parser.add_argument("--fetchers", type=int, default=8, help="fetcher threads (default: 8)")
    parser.add_argument("--publish-interval", type=float, default=1.0, help="seconds between publishes (default: 1)")
    parser.add_argument("--model-bytes", default="4MiB", help="size of the published model (default: 4MiB)")
    parser.add_argument("--json", type=Path, default=None, help="write the result and every sample to this file")
    parser.add_argument(
        "--watch-channels", type=int, default=8, help="WeightClients (gRPC channels) the watchers share (default: 8)"
    )
    parser.add_argument(
        "--transports",
        default="auto,bulk,stream",
        help="fetch transports, assigned to the fetchers in turn (default: auto,bulk,stream; auto = shm here)",
    )
    parser.add_argument(
        "--fetch-pause", type=float, default=0.02, help="seconds each fetcher sleeps between fetches (default: 0.02)"
    )
    parser.add_argument(
        "--sample-interval", type=float, default=0.0, help="seconds between RSS samples (default: seconds/60, 0.5-5)"
    )
    parser.add_argument("--keep", type=int, default=None, help="server --keep (default: the server's default)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra argument for `weightserver serve` (repeatable)"
    )
    args = parser.parse_args(argv)
    args.model_bytes = parse_size(args.model_bytes)
    if args.seconds <= 0 or args.publish_interval <= 0 or args.watchers < 0 or args.fetchers < 0:
        parser.error("--seconds and --publish-interval must be > 0, --watchers and --fetchers >= 0")
    return args


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        seconds=args.seconds,
        watchers=args.watchers,
        fetchers=args.fetchers,
        publish_interval=args.publish_interval,
        model_bytes=args.model_bytes,
        watch_channels=args.watch_channels,
        transports=tuple(t.strip() for t in args.transports.split(",") if t.strip()),
        fetch_pause=args.fetch_pause,
        sample_interval=args.sample_interval,
        keep=args.keep,
        server_args=tuple(args.server_arg),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    return run_from_command_line(lambda stop: run_soak(config, stop=stop), format_summary, args.json)


def run_from_command_line(
    run: Callable[[threading.Event], Any], summary: Callable[[Any], str], json_path: Path | None
) -> int:
    """`run(stop)` with Ctrl-C setting `stop` (end early, shut down cleanly; a second Ctrl-C
    aborts at once), then the summary and wall time on stdout and the result in `json_path`.
    The exit code: 130 interrupted, 0 when the result is ok, else 1."""
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log("interrupted: shutting down (Ctrl-C again to abort)")

    signal.signal(signal.SIGINT, on_sigint)
    started = time.monotonic()
    try:
        result = run(stop)
    finally:
        signal.signal(signal.SIGINT, previous)
    print(summary(result))
    print(f"wall time {time.monotonic() - started:.1f} s")
    if json_path:
        json_path.write_text(json.dumps(asdict(result), indent=1, default=str) + "\n")
        log(f"wrote {json_path}")
    if result.interrupted:
        return 130
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
