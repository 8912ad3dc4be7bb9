"""Chaos: faults at random against a publisher, fetchers and watchers on a real server.

    .venv/bin/python bench/chaos.py [--seconds 600] [--rounds N] [--seed N] [--deadline 10] [--slack 5]
                                    [--faults stop,fill-shm,fill-data,flood-bulk,drop-reply,kill,delete,
                                              stall-publish,rewrite-upload]
                                    [--json FILE]

The load is bench/soak.py's (its Publisher, Fetcher and Watcher, subclassed here): a publisher
changing a model every `--publish-interval` s and recording, under a publish counter (`seq`)
that travels in the version's metadata, the xxh3 of every tensor and the sha256 of the file;
`--fetchers` fetchers (transports auto = shared memory here, bulk, stream) checking every
result against that record; `--watchers` Watch streams. All against a `weightserver serve`
child (weightserver.process.ServerProcess) with `--data-dir` and `--shm-dir` on small tmpfs
mounts this command creates when it runs as root.

Faults run one at a time, in a fresh random order each round (so every fault runs once per
round; `--seed` replays an order), each followed by recovery and a quiet spell:

* stop:       SIGSTOP the server, SIGCONT after a few seconds (every other stop outlasts
              deadline + slack: calls must give up at their deadline, then work again);
* fill-shm:   fill the shared-memory tmpfs with a ballast file, hold, delete it (root only);
* fill-data:  the same on the data-dir tmpfs (root only);
* flood-bulk: open `--flood-connections` idle TCP connections to the bulk port, hold, close;
* drop-reply: the publisher talks through a loopback proxy which, on the next publish, lets
              the request through but drops the connection instead of forwarding the reply
              (the commit has landed); the publisher retries with the same publish id;
* kill:       SIGKILL the server, restart it on the same port, bulk port and data dir;
* delete:     a delete on the primary while a relay follows it: publish two versions of a side
              model (`chaos-deletes`), wait for the relay to hold them, then delete one of them
              (every other run: every version of that model) and a retained version of the
              load's model other than the newest;
* stall-publish: a publisher that sends its header and then nothing for a few seconds (every
              other run: one that opens a publish, sends a header and gives up, every 0.3 s),
              while the load goes on: it must gain no hold over fetches beyond its budget
              (weightserver.publish.priority) and never become a version (`chaos-stalled`);
* rewrite-upload: a same-host writer (raw protocol, Negotiate for shared memory) that truncates
              or rewrites its upload file at a random moment: before `uploaded` (the publish
              must be refused, DATA_LOSS or INVALID_ARGUMENT, and commit nothing) or after the
              commit, through the descriptor it kept (the seal must refuse the change, the
              version must still be served as committed, on every transport, and the server
              must not die of it).

With `delete` among the faults, the load also has a relay: a `weightserver serve --upstream`
child of the server, polling it every `--relay-poll` s, with its own data dir.

Invariants, each a failure category in the summary (exit 1 if any failure):

* hang: a watchdog tracks every call (each has a deadline); one running longer than
  `--deadline` + `--slack` is a hang, as is a watcher that has not received an acknowledged
  version `--deadline` + `--slack` after it was acknowledged (the server stopped or down
  pauses that clock), or a thread that does not stop;
* lost version: after every restart and at the end (after a last graceful restart), every
  acknowledged version is retained and byte-identical (sha256 of the listing and of the
  bytes fetched) or lies below the oldest retained one with `--keep` versions retained;
* reused version: a version number carrying two different publish counters;
* duplicate: one publish counter under two version numbers (a retried publish committed
  twice);
* bad read: a fetched version whose tensors differ from what was published under its counter
  (a torn read), a counter never published, or an older version than was acknowledged;
* crash: the server exits although nobody killed it, fails to restart, or exits non-zero
  on SIGTERM; server error: an ERROR or a traceback in its log (an unhandled error);
* watch: a watcher sees a version out of order or twice, misses a committed version without
  the next event carrying `gap`, or its stream ends; flagged gaps are allowed (a restart or
  eviction) and counted;
* unexpected error: a call fails that began more than `--slack` s after the last fault ended
  (clients reconnect meanwhile); the others are tolerated and counted per fault and type;
* no recovery: within `--recovery` s after a fault, the publisher has not had a publish
  acknowledged, a fetcher has not completed a fetch started after the fault, or a watcher
  (or the relay) has not caught up;
* rewrite: a publish whose upload was changed before `uploaded` committed, or a committed
  version whose bytes (stream or shared memory) differ from what was committed after its
  writer changed the file (`chaos-rewrites`); the stalled publisher's model became visible;
* relay: the relay still serves a version deleted on the primary `--recovery` s after the
  delete (or at the end), or does not get the side model's versions, or its log has an ERROR
  or a traceback, or it exits non-zero on SIGTERM. A deleted version of the load's model is
  no lost version.

Without root the fill faults are skipped (said in the summary). Progress goes to stderr every
10 s, the summary to stdout, everything (faults, failures, per-watcher versions) to `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `bench` is a package

from bench import soak  # noqa: E402
from bench.common import format_size, log, parse_size  # noqa: E402
from weightserver.protocol.errors import IntegrityError  # noqa: E402

MODEL = soak.MODEL
FAULTS = (
    "stop",
    "fill-shm",
    "fill-data",
    "flood-bulk",
    "drop-reply",
    "kill",
    "delete",
    "stall-publish",
    "rewrite-upload",
)
ROOT_FAULTS = ("fill-shm", "fill-data")
CATEGORIES = (
    "hang",
    "lost version",
    "reused version",
    "duplicate",
    "bad read",
    "crash",
    "server error",
    "watch",
    "unexpected error",
    "no recovery",
    "relay",
    "rewrite",
)
# The model the delete fault publishes and deletes (the load's model is MODEL).
SIDE_MODEL = "chaos-deletes"
# The models the stall-publish fault never commits and the rewrite-upload fault publishes.
STALLED_MODEL = "chaos-stalled"
REWRITTEN_MODEL = "chaos-rewrites"
MAX_FAILURES_KEPT = 300
_LOG_ENTRY = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
TICK = 0.1


# ---------------------------------------------------------------------- configuration
@dataclass
class ChaosConfig:
    seconds: float = 600.0
    rounds: int = 0  # at least this many rounds of every fault, past `seconds` if need be
    seed: int | None = None  # None: drawn at start (and reported)
    deadline: float = 10.0  # of every call
    slack: float = 5.0  # a call may overrun its deadline by this much before it is a hang
    faults: tuple[str, ...] = FAULTS
    hold: tuple[float, float] = (2.0, 5.0)  # seconds a fault lasts (a stop, a fill, a flood)
    quiet: tuple[float, float] = (1.0, 3.0)  # seconds between a recovery and the next fault
    recovery: float = 0.0  # 0: 2 x (deadline + slack)
    watchers: int = 8
    fetchers: int = 3
    transports: tuple[str, ...] = ("auto", "bulk", "stream")
    publish_interval: float = 0.5
    model_bytes: int = 1 << 20
    keep: int = 3
    fetch_pause: float = 0.05
    tmpfs_bytes: int = 32 << 20  # each of the shm and data mounts
    flood_connections: int = 1000
    progress_interval: float = 10.0
    relay_poll: float = 0.5  # the relay's --upstream-poll (with the delete fault)
    server_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
        if self.seconds <= 0 or self.deadline <= 0 or self.slack < 0 or self.rounds < 0:
            raise ValueError("seconds and deadline must be > 0, slack and rounds >= 0")
        for name in ("hold", "quiet"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be MIN,MAX with 0 <= MIN <= MAX, got {low},{high}")
        if self.keep < 1 or self.watchers < 0 or self.fetchers < 0 or self.publish_interval <= 0:
            raise ValueError("keep must be >= 1, watchers and fetchers >= 0, publish interval > 0")
        if self.relay_poll <= 0:
            raise ValueError("relay poll must be > 0")

    @property
    def recovery_seconds(self) -> float:
        return self.recovery or 2 * (self.deadline + self.slack)


# ---------------------------------------------------------------------- shared state
@dataclass
class Failure:
    t: float
    category: str
    fault: str  # the fault running or recovering when it happened, "-" for none
    source: str
    message: str


@dataclass
class FaultRecord:
    index: int
    name: str
    started: float  # seconds since the run started
    ended: float = 0.0
    recovered_after: float | None = None  # seconds from the end of the fault to recovery
    details: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    tolerated: dict[str, int] = field(default_factory=dict)  # "source: ErrorType" -> count

    @property
    def label(self) -> str:
        return f"{self.name}#{self.index}"


class ChaosState(soak.SoakState):
    """SoakState plus failures by category, the fault timeline and every (version, seq) pair
    observed anywhere (acks, watch events, fetches, listings)."""

    def __init__(self, config: ChaosConfig) -> None:
        super().__init__()
        self.config = config
        self.failures: list[Failure] = []
        self.failure_counts: Counter[str] = Counter()
        self.faults: list[FaultRecord] = []
        self.current: FaultRecord | None = None  # running, or still in its recovery window
        self.phase = "-"  # what failures outside a fault's window are put down to
        self.active = False  # the current fault is being applied
        self.fault_ended = 0.0  # monotonic end of the current fault
        self.disrupted = False  # server stopped or down: watchers cannot progress
        self.disrupted_until = 0.0  # monotonic end of the last such spell
        self.sha256: dict[int, str] = {}  # seq -> sha256 of the published file
        self.ack_time: dict[int, float] = {}  # version -> monotonic time acknowledged
        self.acked_seq: dict[int, int] = {}  # seq -> the version its publish was acknowledged as
        self.seq_versions: dict[int, set[int]] = {}
        self.version_seqs: dict[int, set[int]] = {}
        self.gaps: list[dict[str, Any]] = []  # flagged gaps seen by watchers
        self.deleted: set[tuple[str, int]] = set()  # (model, version) deleted on the primary

    def fault_label(self) -> str:
        current = self.current
        return current.label if current is not None else self.phase

    def fail(self, category: str, source: str, message: str) -> None:
        with self._lock:
            self.failure_counts[category] += 1
            if self.current is not None:
                self.current.failures += 1
            if len(self.failures) < MAX_FAILURES_KEPT:
                self.failures.append(Failure(round(self.elapsed(), 3), category, self.fault_label(), source, message))
        log(f"FAIL [{category}] {self.fault_label()} {source}: {message}")

    def error(self, source: str, message: str) -> None:
        """The soak's own checks (its Fetcher, Watcher and Publisher report through here)."""
        category = "bad read" if source.startswith("fetcher") else "watch" if source.startswith("watcher") else None
        self.fail(category or "reused version", source, message)

    def call_failed(self, source: str, kind: str, what: str, exc: BaseException, started: float) -> None:
        """A call begun at `started` (monotonic) raised. Tolerated (counted by `kind` and error
        type) if it failed during a fault or began before `slack` s after its end (clients
        reconnect meanwhile); else, and always for an IntegrityError, a failure."""
        text = f"{what}: {type(exc).__name__}: {exc}"
        if isinstance(exc, IntegrityError):
            self.fail("bad read", source, text)
            return
        with self._lock:
            current = self.current
            window = self.active or started < self.fault_ended + self.config.slack
            tolerated = current is not None and window
            if current is not None and window:
                key = f"{kind} {type(exc).__name__}"
                current.tolerated[key] = current.tolerated.get(key, 0) + 1
        if not tolerated:
            self.fail("unexpected error", source, text)

    def ack(self, version: int, seq: int) -> None:
        super().ack(version, seq)
        self.ack_time[version] = time.monotonic()
        self.acked_seq[seq] = version
        self.observe(version, seq, "publisher")

    def observe(self, version: int, seq: int, source: str) -> None:
        """Record that `version` carries `seq`; a second version for a seq is a duplicate, a
        second seq for a version a reused number."""
        with self._lock:
            versions = self.seq_versions.setdefault(seq, set())
            seqs = self.version_seqs.setdefault(version, set())
            duplicate = version not in versions and bool(versions)
            reused = seq not in seqs and bool(seqs)
            versions.add(version)
            seqs.add(seq)
            before_v, before_s = sorted(versions - {version}), sorted(seqs - {seq})
        if duplicate:
            self.fail("duplicate", source, f"publish seq {seq} committed twice: as v{version} and {_vs(before_v)}")
        if reused:
            self.fail("reused version", source, f"v{version} carries seq {seq}, elsewhere seq {before_s}")

    def begin(self, record: FaultRecord) -> None:
        with self._lock:
            self.faults.append(record)
            self.current = record
            self.active = True

    def end(self, record: FaultRecord) -> None:
        with self._lock:
            record.ended = round(self.elapsed(), 3)
            self.active = False
            self.fault_ended = time.monotonic()

    def settle(self) -> None:
        """After a recovery: once no call that may fail because of the fault can still be
        running (deadline + slack after its end), failures are no longer put down to it."""
        with self._lock:
            if (
                self.current is not None
                and time.monotonic() >= self.fault_ended + self.config.deadline + self.config.slack
            ):
                self.current = None


def _vs(versions: list[int]) -> str:
    return ", ".join(f"v{v}" for v in versions)


# ---------------------------------------------------------------------- watchdog
@dataclass
class _Call:
    source: str
    what: str
    started: float
    deadline: float
    flagged: bool = False


class Watchdog:
    """Records calls in flight; a thread flags any that outlives its deadline + slack, and
    watchers that fall behind the acknowledged versions for as long."""

    def __init__(self, state: ChaosState, slack: float) -> None:
        self.state = state
        self.slack = slack
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._next = 0
        self.longest: dict[str, float] = {}  # call kind -> longest seconds
        self.calls = 0
        self.watchers: list[ChaosWatcher] = []
        self._thread = threading.Thread(target=self._run, name="chaos-watchdog", daemon=True)
        self._done = threading.Event()

    @contextlib.contextmanager
    def call(self, source: str, what: str, deadline: float) -> Iterator[None]:
        call = _Call(source, what, time.monotonic(), deadline)
        with self._lock:
            self._next += 1
            key = self._next
            self._calls[key] = call
            self.calls += 1
        try:
            yield
        finally:
            took = time.monotonic() - call.started
            with self._lock:
                del self._calls[key]
                kind = what.split(" (")[0]
                self.longest[kind] = max(self.longest.get(kind, 0.0), round(took, 3))
                late = took > deadline + self.slack and not call.flagged
            if late:
                self.state.fail("hang", source, f"{what} took {took:.1f}s (deadline {deadline:g}s)")

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self.check()

    def check(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._calls.values() if not c.flagged and now - c.started > c.deadline + self.slack]
            for call in late:
                call.flagged = True
        for call in late:
            self.state.fail(
                "hang",
                call.source,
                f"{call.what} still running after {now - call.started:.1f}s (deadline {call.deadline:g}s)",
            )
        state = self.state
        if state.disrupted or not state.acked:
            return
        latest = state.acked_max
        acked_at = state.ack_time.get(latest, now)
        due = max(acked_at, state.disrupted_until) + state.config.deadline + self.slack
        if now < due:
            return
        for watcher in self.watchers:
            last = watcher.last()
            if last < latest and watcher.stuck_at != last:
                watcher.stuck_at = last
                state.fail(
                    "hang", watcher.name, f"still at v{last} {now - acked_at:.1f}s after v{latest} was acknowledged"
                )


# ---------------------------------------------------------------------- load
class ChaosPublisher(soak.Publisher):
    """soak.Publisher whose publishes go through `publish_group_bytes` with a deadline, and are
    retried until acknowledged, with the same publish id when the client has that API (an id
    lets the server commit a retried publish once; without it a retry after a lost reply
    commits twice, which the run reports as a duplicate)."""

    def __init__(self, address: str, state: ChaosState, config: ChaosConfig, watchdog: Watchdog) -> None:
        super().__init__(address, state, config.model_bytes, config.publish_interval)
        self.chaos = state
        self.deadline = config.deadline
        self.watchdog = watchdog
        self.has_publish_id = "publish_id" in inspect.signature(self.client.publish_group_bytes).parameters
        self.current_seq = 0
        self.attempts = 0
        self.retries = 0
        self.last_acked_attempt = 0.0  # monotonic start of the attempt acknowledged last

    def _send(self, seq: int) -> int | None:
        from weightclient import tensors as tensor_codec

        data = tensor_codec.snapshot(self.weights)  # the file, kept as is for every retry
        digest = hashlib.sha256(data).hexdigest()
        self.chaos.sha256[seq] = digest
        self.current_seq = seq
        options = {"publish_id": uuid.uuid4().hex} if self.has_publish_id else {}
        attempt = 0
        while True:
            attempt += 1
            self.attempts += 1
            started = time.monotonic()
            try:
                with self.watchdog.call("publisher", f"publish (seq {seq}, attempt {attempt})", self.deadline):
                    infos = self.client.publish_group_bytes(
                        {MODEL: data},
                        metadata={"seq": str(seq)},
                        sha256s={MODEL: digest},
                        timeout=self.deadline,
                        **options,
                    )
                self.last_acked_attempt = started
                return infos[0].version
            except Exception as exc:
                self.chaos.call_failed("publisher", "publish", f"publish seq {seq} attempt {attempt}", exc, started)
            if self.state.stop.wait(min(2.0, 0.1 * 2**attempt)):
                return None
            self.retries += 1


class ChaosFetcher(soak.Fetcher):
    """soak.Fetcher with every fetch under the watchdog, failures judged by the fault window,
    and every result's (version, seq) observed."""

    def __init__(self, index: int, address: str, state: ChaosState, config: ChaosConfig, watchdog: Watchdog) -> None:
        transport = config.transports[index % len(config.transports)]
        super().__init__(index, address, state, transport, config.fetch_pause, timeout=config.deadline)
        self.chaos = state
        self.watchdog = watchdog
        self.last_ok_started = 0.0
        self.started = 0.0  # of the fetch running or last run

    def _fetch(self, kind: str) -> None:
        self.started = time.monotonic()
        calls = 2 if kind == "describe_then_fetch" else 1  # latest() then fetch(): two deadlines
        with self.watchdog.call(self.name, f"{kind} fetch ({self.transport})", calls * self.timeout):
            super()._fetch(kind)
        self.last_ok_started = self.started

    def _failed(self, kind: str, exc: Exception) -> None:
        self.counts.errors += 1
        what = f"{kind} fetch ({self.transport})"
        self.chaos.call_failed(self.name, f"fetch/{self.transport}", what, exc, self.started)

    def _check(self, result: Any, kind: str, acked_before: int) -> None:
        seq = result.metadata.get("seq", "")
        self.chaos.observe(result.version, int(seq) if seq.isdigit() else -1, self.name)
        super()._check(result, kind, acked_before)


class ChaosWatcher(soak.Watcher):
    """soak.Watcher that allows gaps the server flags (counted), records each event's flag
    and observes every (version, seq)."""

    def __init__(self, index: int, client: Any, state: ChaosState) -> None:
        super().__init__(index, client, state)
        self.chaos = state
        self.flags: list[bool] = []  # parallel to self.versions: the event's gap flag
        self.stuck_at: int | None = None  # the version the watchdog last reported it stuck at

    def _on_event(self, event: Any, received: float) -> None:
        seq = event.info.metadata.get("seq", "")
        self.chaos.observe(event.version, int(seq) if seq.isdigit() else -1, self.name)
        self.flags.append(bool(event.gap))
        super()._on_event(event, received)

    def _on_gap(self, version: int) -> None:
        self.gaps += 1
        state = self.chaos
        across_restart = state.disrupted or time.monotonic() < state.disrupted_until + state.config.deadline
        state.gaps.append(
            {"t": round(state.elapsed(), 3), "watcher": self.name, "version": version, "across_restart": across_restart}
        )


# ---------------------------------------------------------------------- fault tools
class ReplyDropProxy:
    """A loopback TCP proxy for the publisher's gRPC channel. Bytes pass both ways; once
    armed, the first HTTP/2 HEADERS frame the server sends on a stream (the start of a reply:
    a unary-reply call sends it after the handler returned, so the publish has committed) is
    not forwarded: both sides of that connection are closed instead."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._armed = threading.Event()
        self.fired = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="chaos-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def arm(self) -> None:
        self.fired.clear()
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for sock in list(self._sockets):
                _close(sock)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
                server.settimeout(None)
            except OSError:
                _close(client)  # the server is down: the client sees UNAVAILABLE
                continue
            with self._lock:
                self._sockets |= {client, server}
            pair = (client, server)
            threading.Thread(target=self._forward, args=(client, server, pair), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, pair), daemon=True).start()

    def _forward(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, ...]) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        self._drop(pair)

    def _replies(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, ...]) -> None:
        """Forward the server's HTTP/2 frames one by one (9-byte header: length, type, flags,
        stream id), dropping the connection at a reply's HEADERS frame when armed."""
        with contextlib.suppress(OSError, EOFError):
            while True:
                header = _recv_exactly(src, 9)
                payload = _recv_exactly(src, int.from_bytes(header[:3], "big"))
                stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                if header[3] == 0x1 and stream and self._armed.is_set():
                    self._armed.clear()
                    self.fired.set()
                    break
                dst.sendall(header + payload)
        self._drop(pair)

    def _drop(self, pair: tuple[socket.socket, ...]) -> None:
        with self._lock:
            for sock in pair:
                self._sockets.discard(sock)
                _close(sock)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise EOFError
        data += part
    return bytes(data)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _connected(conn: socket.socket) -> bool:
    try:
        conn.getpeername()
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Mounts:
    """A temporary folder with `shm/` and `data/` for the server: small tmpfs mounts when
    running as root (so that they can be filled), plain folders otherwise."""

    def __init__(self, size: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="weightserver-chaos-"))
        self.shm = self.root / "shm"
        self.data = self.root / "data"
        self.mounted: list[Path] = []
        self.why_not = ""
        for path in (self.shm, self.data):
            path.mkdir()
        if os.geteuid() != 0:
            self.why_not = "not root: cannot mount a small tmpfs to fill"
            return
        for path in (self.shm, self.data):
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                self.why_not = f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
                self._unmount()  # both plain folders, then
                return
            self.mounted.append(path)

    def _unmount(self) -> None:
        for path in reversed(self.mounted):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True)
        self.mounted = []

    def close(self) -> None:
        self._unmount()
        shutil.rmtree(self.root, ignore_errors=True)


def _fill(directory: Path) -> tuple[Path, int]:
    """Fill the file system holding `directory` with a ballast file; (its path, its size)."""
    ballast = directory / "chaos-ballast"
    free = shutil.disk_usage(directory).free
    fd = os.open(ballast, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, free)
        block = b"\0" * 65536
        with contextlib.suppress(OSError):  # whatever fallocate left (rounding, races): ENOSPC ends it
            os.lseek(fd, 0, os.SEEK_END)
            while True:
                os.write(fd, block)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return ballast, size


class LogTail:
    """The log entries (a timestamped line and the lines that follow it, e.g. a traceback)
    appended to a file since the last call; the newest is held back until the next one
    starts, or `final`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""
        self._entry: list[str] = []

    def entries(self, final: bool = False) -> list[list[str]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            data = b""
        self.offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        entries = []
        for line in (raw.decode(errors="replace") for raw in complete):
            if _LOG_ENTRY.match(line) and self._entry:
                entries.append(self._entry)
                self._entry = []
            self._entry.append(line)
        if final and self._entry:
            entries.append(self._entry)
            self._entry = []
        return entries


# ---------------------------------------------------------------------- the run
@dataclass
class ChaosResult:
    config: dict[str, Any]
    seed: int = 0
    duration: float = 0.0
    interrupted: bool = False
    aborted: str = ""
    publish_id: bool = False
    skipped: dict[str, str] = field(default_factory=dict)  # fault -> why
    faults: list[dict[str, Any]] = field(default_factory=list)
    acked_versions: list[int] = field(default_factory=list)
    publish_attempts: int = 0
    publish_retries: int = 0
    unacknowledged_committed: list[int] = field(default_factory=list)
    retained_at_end: list[int] = field(default_factory=list)
    fetches: int = 0
    fetch_transports: dict[str, int] = field(default_factory=dict)
    evicted_retries: int = 0
    calls: int = 0
    longest_call: dict[str, float] = field(default_factory=dict)
    tolerated_errors: int = 0
    gaps: list[dict[str, Any]] = field(default_factory=list)
    watchers: list[dict[str, Any]] = field(default_factory=list)
    server_restarts: int = 0
    server_exit_code: int | None = None
    server_log_warnings: int = 0
    relay_exit_code: int | None = None
    relay_log_warnings: int = 0
    failure_counts: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    ok: bool = False


class _Abort(Exception):
    """The run cannot go on (e.g. the server does not restart)."""


class Chaos:
    def __init__(self, config: ChaosConfig, interrupt: threading.Event, on_progress: Callable[[str], None]) -> None:
        self.config = config
        self.interrupt = interrupt
        self.on_progress = on_progress
        seed = config.seed if config.seed is not None else random.SystemRandom().randrange(1 << 32)
        self.rng = random.Random(seed)
        self.state = ChaosState(config)
        self.result = ChaosResult(config=asdict(config), seed=seed)
        self.watchdog = Watchdog(self.state, config.slack)
        self.expect_exit = False
        self.stops = 0

    # ------------------------------------------------------------------ outline
    def run(self) -> ChaosResult:
        from weightclient import WeightClient
        from weightserver.process import ServerProcess

        config, state, result = self.config, self.state, self.result
        self.mounts = Mounts(config.tmpfs_bytes)
        enabled = list(config.faults)
        if not self.mounts.mounted:
            for name in ROOT_FAULTS:
                if name in enabled:
                    enabled.remove(name)
                    result.skipped[name] = self.mounts.why_not
        shm_args = ["--shm-dir", str(self.mounts.shm)] if self.mounts.mounted else []
        self.bulk_port = _free_port()
        args = ["--data-dir", str(self.mounts.data), "--keep", str(config.keep), "--bulk-port", str(self.bulk_port)]
        self.server = ServerProcess(*args, *shm_args, *config.server_args)
        self.log_tail = LogTail(self.server.log_path)
        self.proxy: ReplyDropProxy | None = None
        self.publisher: ChaosPublisher | None = None
        self.fetchers: list[ChaosFetcher] = []
        self.watchers: list[ChaosWatcher] = []
        self.watch_clients: list[Any] = []
        self.clients_closed = False
        self.admin: Any = None
        self.relay: ServerProcess | None = None
        self.relay_client: Any = None
        self.deletes = 0
        try:
            self.server.start()
            self.pid = self.server.process.pid if self.server.process else 0
            self.on_progress(
                f"chaos: seed {result.seed}, server pid {self.pid} on {self.server.address} (bulk {self.bulk_port}), "
                f"data {self.mounts.data}, log {self.server.log_path}"
            )
            self.admin = WeightClient(self.server.address, client_id="chaos-admin", timeout=config.deadline)
            if "delete" in enabled:  # a relay follows the server, with a data dir of its own
                relay_args = ["--upstream", self.server.address, "--upstream-poll", str(config.relay_poll)]
                relay_args += ["--keep", str(config.keep), "--data-dir", str(self.mounts.root / "relay-data")]
                self.relay = ServerProcess(*relay_args)
                self.relay_log = LogTail(self.relay.log_path)
                self.relay.start()
                self.relay_client = WeightClient(self.relay.address, client_id="chaos-relay", timeout=config.deadline)
                self.on_progress(f"chaos: relay on {self.relay.address}, log {self.relay.log_path}")
            self.proxy = ReplyDropProxy(self.server.port)
            self.publisher = ChaosPublisher(self.proxy.address, state, config, self.watchdog)
            result.publish_id = self.publisher.has_publish_id
            if self.publisher.publish_one() is None:
                raise _Abort("the first publish failed")
            channels = max(1, min(4, config.watchers))
            self.watch_clients = [
                WeightClient(self.server.address, client_id=f"chaos-watch-{i}") for i in range(channels)
            ]
            clients = self.watch_clients
            self.watchers = [ChaosWatcher(i, clients[i % channels], state) for i in range(config.watchers)]
            self.watchdog.watchers = self.watchers
            for watcher in self.watchers:
                watcher.thread.start()
            for watcher in self.watchers:
                if not watcher.wait_for(state.acked[0], 60):
                    raise _Abort(f"{watcher.name} did not receive v{state.acked[0]} within 60 s")
            self.fetchers = [
                ChaosFetcher(i, self.server.address, state, config, self.watchdog) for i in range(config.fetchers)
            ]
            state.started = time.monotonic()
            self.next_progress = state.started + config.progress_interval
            self.watchdog.start()
            for fetcher in self.fetchers:
                fetcher.thread.start()
            self.publisher.thread.start()
            self.on_progress(f"chaos: faults {', '.join(enabled) or 'none'} for {config.seconds:g}s")
            self._faults(enabled)
            result.duration = state.elapsed()
            self._wind_down()
            if not self.interrupt.is_set():
                self._final_audit()
        except _Abort as exc:
            result.aborted = str(exc)
            state.fail("crash", "chaos", f"run aborted: {exc}")
        finally:
            result.duration = result.duration or state.elapsed()
            state.stop.set()
            try:
                self.watchdog.stop()
                self._close_clients()
                if self.admin is not None:
                    self.admin.close()
                if self.relay_client is not None:
                    self.relay_client.close()
                if self.proxy is not None:
                    self.proxy.close()
            finally:
                self._stop_server()
                self._stop_relay()
                self.mounts.close()
        self._summarise()
        return result

    def _faults(self, enabled: list[str]) -> None:
        """Faults one at a time, each name once per round in a fresh random order, for `seconds`
        and at least `rounds` whole rounds."""
        config, state = self.config, self.state
        end = state.started + config.seconds
        round_: list[str] = []
        finished = 0  # rounds in which every fault ran
        self._pause(self.rng.uniform(*config.quiet))
        while enabled and not self.interrupt.is_set() and (time.monotonic() < end or finished < config.rounds):
            if not round_:
                round_ = self.rng.sample(enabled, len(enabled))
            name = round_.pop()
            finished += not round_
            record = FaultRecord(len(state.faults) + 1, name, round(state.elapsed(), 3))
            self.on_progress(f"chaos: t={record.started:.0f}s {record.label}")
            state.begin(record)
            try:
                getattr(self, "_" + name.replace("-", "_"))(record)
            finally:
                state.end(record)
            self._recover(record)
            self._pause(self.rng.uniform(*config.quiet))
            state.settle()
        if not enabled:
            self._pause(max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------------ faults
    def _stop(self, record: FaultRecord) -> None:
        self.stops += 1
        long = self.stops % 2 == 0
        # A long stop outlasts deadline + slack: a call without a deadline of its own shows as a hang.
        outlast = self.config.deadline + self.config.slack
        hold = outlast + self.rng.uniform(1, 3) if long else self.rng.uniform(*self.config.hold)
        record.details.update(seconds=round(hold, 2), outlasts_deadline=long)
        process = self.server.process
        assert process is not None
        self.state.disrupted = True
        os.kill(process.pid, signal.SIGSTOP)
        try:
            self._pause(hold, check_server=False)
        finally:
            os.kill(process.pid, signal.SIGCONT)
            self.state.disrupted_until = time.monotonic()
            self.state.disrupted = False

    def _fill_shm(self, record: FaultRecord) -> None:
        self._fill(record, self.mounts.shm)

    def _fill_data(self, record: FaultRecord) -> None:
        self._fill(record, self.mounts.data)

    def _fill(self, record: FaultRecord, directory: Path) -> None:
        record.details["free_before"] = shutil.disk_usage(directory).free
        ballast, size = _fill(directory)
        try:
            record.details.update(ballast_bytes=size, free_during=shutil.disk_usage(directory).free)
            self._pause(self.rng.uniform(*self.config.hold))
        finally:
            ballast.unlink(missing_ok=True)

    def _flood_bulk(self, record: FaultRecord) -> None:
        conns: list[socket.socket] = []
        threads_before = soak._threads(self.pid)
        try:
            for _ in range(self.config.flood_connections):
                conn = socket.socket()
                conns.append(conn)
                conn.setblocking(False)  # the kernel completes (or retries) each handshake meanwhile
                conn.connect_ex(("127.0.0.1", self.bulk_port))
            self._pause(self.rng.uniform(*self.config.hold))
            record.details.update(
                connections=sum(1 for conn in conns if _connected(conn)),
                threads_before=threads_before,
                threads_during=soak._threads(self.pid),
            )
        finally:
            for conn in conns:
                conn.close()

    def _drop_reply(self, record: FaultRecord) -> None:
        assert self.proxy is not None and self.publisher is not None
        self.proxy.arm()
        limit = time.monotonic() + self.config.deadline + 4 * self.config.publish_interval
        while not self.proxy.fired.is_set() and time.monotonic() < limit and not self.interrupt.is_set():
            self._pause(0.02)
        self.proxy.disarm()
        if not self.proxy.fired.is_set():
            record.details["fired"] = False
            return
        seq = self.publisher.current_seq
        record.details.update(fired=True, seq=seq)
        # Did the publish whose reply was lost commit? Ask the server directly.
        with contextlib.suppress(Exception):
            with self.watchdog.call("chaos", "list_versions", self.config.deadline):
                listed = self.admin.list_versions(MODEL)
            committed = [v.version for v in listed if v.metadata.get("seq") == str(seq)]
            record.details["committed_before_reply_lost"] = committed
        limit = time.monotonic() + self.config.recovery_seconds
        while seq not in self.state.acked_seq and time.monotonic() < limit:
            self._pause(0.05)
        record.details["acknowledged_as"] = self.state.acked_seq.get(seq)

    def _kill(self, record: FaultRecord) -> None:
        down = self.rng.uniform(0.0, 1.0)
        record.details["down_seconds"] = round(down, 2)
        self.state.disrupted = True
        try:
            self.expect_exit = True
            self.server.kill()
            self.expect_exit = False
            self._pause(down, check_server=False)
            self._restart(record, "kill")
        finally:
            self.state.disrupted_until = time.monotonic()
            self.state.disrupted = False

    def _delete(self, record: FaultRecord) -> None:
        """Deletes on the primary while the relay follows: the relay must stop serving every
        deleted version within the recovery window."""
        import torch

        from weightclient import NotFoundError

        assert self.relay_client is not None
        config, state = self.config, self.state
        self.deletes += 1
        every = self.deletes % 2 == 0
        limit = time.monotonic() + config.recovery_seconds
        try:
            side = []
            for _ in range(2):
                weights = {"w": torch.full((256,), float(self.deletes))}
                with self.watchdog.call("chaos", "side publish", config.deadline):
                    side.append(self.admin.publish(weights, SIDE_MODEL, timeout=config.deadline, transport="stream"))
            if not self._relay_until(lambda: set(side) <= set(self._relay_holds(SIDE_MODEL)), limit):
                state.fail("relay", "relay", f"did not get {SIDE_MODEL} {_vs(side)} within the recovery window")
                return
            with self.watchdog.call("chaos", "list_versions", config.deadline):
                side_listed = [v.version for v in self.admin.list_versions(SIDE_MODEL)]
                listed = [v.version for v in self.admin.list_versions(MODEL)]
            doomed = [(SIDE_MODEL, v) for v in (side_listed if every else side[:1])]
            if len(listed) >= 2:  # not the newest: fetchers of the latest are not set back
                doomed.append((MODEL, listed[-2]))
            deleted = []
            for model, version in doomed:
                try:
                    with self.watchdog.call("chaos", "delete", config.deadline):
                        self.admin.delete(model, version)
                except NotFoundError:  # evicted meanwhile (the load's model): nothing to delete
                    continue
                state.deleted.add((model, version))
                deleted.append((model, version))
        except Exception as exc:
            state.fail("unexpected error", "chaos", f"delete fault: {type(exc).__name__}: {exc}")
            return
        started = time.monotonic()
        record.details.update(deleted=[f"{model} v{version}" for model, version in deleted], every_side_version=every)

        def served() -> list[str]:
            return [f"{m} v{v}" for m, v in deleted if v in self._relay_holds(m)]

        if self._relay_until(lambda: not served(), started + config.recovery_seconds):
            record.details["relay_dropped_after"] = round(time.monotonic() - started, 3)
        else:
            state.fail(
                "relay", "relay", f"still serves {', '.join(served())} {config.recovery_seconds:g}s after the delete"
            )

    def _stall_publish(self, record: FaultRecord) -> None:
        """A publisher that holds a publish open without its bytes (or reopens such publishes):
        the load must go on, and nothing of it may become a version."""
        import grpc

        from weightserver.v1 import weights_pb2 as pb
        from weightserver.v1 import weights_pb2_grpc as pb_grpc

        config, state = self.config, self.state
        reopen = sum(1 for f in state.faults if f.name == "stall-publish") % 2 == 0
        hold = self.rng.uniform(*config.hold)
        header = pb.PublishHeader(model=STALLED_MODEL, total_bytes=1 << 20)
        fetches_before = self._fetches()
        record.details.update(mode="reopen" if reopen else "stall", seconds=round(hold, 2))
        given_up = threading.Event()

        def messages(seconds: float) -> Iterator[Any]:
            yield pb.PublishRequest(header=header)
            given_up.wait(seconds)  # nothing more: no bytes, no commit

        opened = 0
        with grpc.insecure_channel(self.server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            end = time.monotonic() + hold
            while time.monotonic() < end and not self.interrupt.is_set():
                seconds = 0.3 if reopen else hold
                call = stub.Publish.future(messages(seconds), timeout=seconds + config.deadline)
                opened += 1
                self._pause(min(seconds, max(0.0, end - time.monotonic())))
                call.cancel()
                given_up.set()
                given_up = threading.Event()
        record.details.update(publishes=opened, fetches_during=self._fetches() - fetches_before)
        with contextlib.suppress(Exception), self.watchdog.call("chaos", "list_models", config.deadline):
            visible = [m.model for m in self.admin.list_models()]
            if STALLED_MODEL in visible:
                state.fail("rewrite", "chaos", f"the stalled publisher's model {STALLED_MODEL} became visible")

    def _fetches(self) -> int:
        return sum(f.counts.total for f in self.fetchers)

    def _rewrite_upload(self, record: FaultRecord) -> None:
        """A same-host writer that changes its upload before `uploaded` (refused, nothing committed)
        or after the commit through the descriptor it kept (the seal refuses; served as committed)."""
        import grpc
        import torch
        import xxhash

        from weightclient import WeightClient
        from weightclient import tensors as tensor_codec
        from weightserver.v1 import weights_pb2 as pb
        from weightserver.v1 import weights_pb2_grpc as pb_grpc

        config, state = self.config, self.state
        when = self.rng.choice(["before", "after"])
        how = self.rng.choice(["truncate", "rewrite"])
        record.details.update(when=when, how=how)
        weights = {"w": torch.full((1 << 18,), float(len(state.faults)))}
        data = b"".join(bytes(part) for part in tensor_codec.encode(weights))
        header = pb.PublishHeader(model=REWRITTEN_MODEL, total_bytes=len(data))
        digest = xxhash.xxh3_128_hexdigest(data)

        def change(fd: int) -> None:
            if how == "truncate":
                os.ftruncate(fd, self.rng.choice([0, len(data) // 2]))
            else:
                os.pwrite(fd, os.urandom(4096), self.rng.randrange(0, len(data) - 4096))

        try:
            with grpc.insecure_channel(self.server.address) as channel:
                stub = pb_grpc.WeightServiceStub(channel)
                request = pb.NegotiateRequest(
                    direction=pb.DIRECTION_PUBLISH, accept=[pb.TRANSPORT_SHARED_MEMORY], publish=header
                )
                with self.watchdog.call("chaos", "rewrite negotiate", config.deadline):
                    answer = stub.Negotiate(request, timeout=config.deadline)
                if answer.transport != pb.TRANSPORT_SHARED_MEMORY:
                    record.details["offered"] = pb.Transport.Name(answer.transport)
                    return  # shared memory full (a fill fault ran before): nothing to test
                fd = os.open(answer.payload.shared_memory.path, os.O_RDWR)
                try:
                    os.pwrite(fd, data, 0)
                    if when == "before":
                        change(fd)
                    messages = [
                        pb.PublishRequest(header=header),
                        pb.PublishRequest(uploaded=pb.PublishUploaded(upload=answer.upload, xxh3=digest)),
                        pb.PublishRequest(commit=pb.PublishCommit()),
                    ]
                    try:
                        with self.watchdog.call("chaos", "rewrite publish", config.deadline):
                            reply = stub.Publish(iter(messages), timeout=config.deadline)
                    except grpc.RpcError as exc:
                        record.details["refused"] = exc.code().name
                        if when == "after" or exc.code() not in (
                            grpc.StatusCode.DATA_LOSS,
                            grpc.StatusCode.INVALID_ARGUMENT,
                        ):
                            why = f"{exc.code().name}: {exc.details()}"
                            state.fail("rewrite", "chaos", f"a publish changed {when} `uploaded` got {why}")
                        return
                    if when == "before":
                        state.fail("rewrite", "chaos", f"a publish whose upload was {how}d before `uploaded` committed")
                        return
                    try:  # after the commit, through the descriptor kept: the seal refuses it
                        change(fd)
                    except PermissionError:
                        record.details["after"] = "refused by the seal"
                    else:
                        state.fail("rewrite", "chaos", f"a committed upload could be {how}d through a kept descriptor")
                finally:
                    os.close(fd)
            version = reply.version.version
            record.details["version"] = version
            with WeightClient(self.server.address, client_id="chaos-rewrite", timeout=config.deadline) as client:
                for transport in ("stream", "shm"):
                    with self.watchdog.call("chaos", f"rewrite fetch ({transport})", config.deadline):
                        fetched = client.fetch_bytes(
                            REWRITTEN_MODEL, version=version, transport=transport, timeout=config.deadline
                        )
                    if bytes(fetched.data) != data:
                        state.fail("rewrite", "chaos", f"v{version} over {transport} is not what was committed")
        except Exception as exc:
            if self.server.process is not None and self.server.process.poll() is not None:
                return  # the server died: _check_server reports the crash
            state.fail("unexpected error", "chaos", f"rewrite-upload fault: {type(exc).__name__}: {exc}")

    def _relay_holds(self, model: str) -> list[int]:
        """The versions of `model` the relay lists ([] for none)."""
        from weightclient import ModelNotFound

        with self.watchdog.call("chaos", "relay list_versions", self.config.deadline):
            try:
                return [v.version for v in self.relay_client.list_versions(model)]
            except ModelNotFound:
                return []

    def _relay_until(self, condition: Callable[[], bool], limit: float) -> bool:
        """Whether `condition` (about the relay) holds before `limit` (monotonic); asked every 0.1 s."""
        while not self.interrupt.is_set():
            try:
                if condition():
                    return True
            except Exception as exc:  # the relay does not answer: a failure of its own
                self.state.fail("relay", "relay", f"{type(exc).__name__}: {exc}")
                return False
            if time.monotonic() > limit:
                return False
            self._pause(0.1)
        return False

    def _stop_relay(self) -> None:
        if self.relay is None or self.relay.process is None:
            return
        try:
            self.result.relay_exit_code = code = self.relay.stop(timeout=30)
        except Exception:
            self.relay.kill()
            code = None
        if code != 0:
            self.state.fail("relay", "relay", f"exit code {code} after SIGTERM (expected 0)")
        self._read_log(final=True)

    # ------------------------------------------------------------------ server life
    def _restart(self, record: FaultRecord | None, why: str) -> None:
        started = time.monotonic()
        try:
            self.server.start(timeout=30)
        except Exception as exc:
            raise _Abort(f"the server did not restart after {why}: {type(exc).__name__}: {exc}") from exc
        self.pid = self.server.process.pid if self.server.process else 0
        self.result.server_restarts += 1
        if record is not None:
            record.details["restart_seconds"] = round(time.monotonic() - started, 2)
        self._read_log()
        retained = self._check_retained(f"after restart ({why})")
        if record is not None:
            record.details["retained_after_restart"] = retained

    def _check_retained(self, when: str) -> list[int]:
        """List the retained versions: each must carry a published seq and its file's sha256;
        every acknowledged version must be among them or below the oldest with --keep kept."""
        state, keep = self.state, self.config.keep
        acked = sorted(state.acked)  # before the listing: each of these was committed by then
        try:
            with self.watchdog.call("chaos", "list_versions", self.config.deadline):
                listed = self.admin.list_versions(MODEL)
        except Exception as exc:
            state.fail("lost version", "audit", f"{when}: list_versions failed: {type(exc).__name__}: {exc}")
            return []
        retained = [info.version for info in listed]
        for info in listed:
            seq_text = info.metadata.get("seq", "")
            seq = int(seq_text) if seq_text.isdigit() else -1
            state.observe(info.version, seq, "audit")
            if seq not in state.sha256:
                state.fail("bad read", "audit", f"{when}: v{info.version} has seq {seq_text!r}, never published")
            elif info.sha256 != state.sha256[seq]:
                state.fail("bad read", "audit", f"{when}: v{info.version} (seq {seq}) sha256 differs from published")
        oldest = retained[0] if retained else None
        deleted = {v for m, v in state.deleted if m == MODEL}  # by the delete fault: not lost
        lost = [v for v in acked if v not in retained and v not in deleted and (oldest is None or v > oldest)]
        if lost:
            state.fail("lost version", "audit", f"{when}: acknowledged {_vs(lost)} gone; retained {_vs(retained)}")
        evicted = [v for v in acked if oldest is not None and v < oldest and v not in deleted]
        if evicted and len(retained) < keep - sum(1 for v in deleted if oldest is not None and v > oldest):
            state.fail(
                "lost version",
                "audit",
                f"{when}: {_vs(evicted[-3:])} gone with only {len(retained)} retained (--keep {keep})",
            )
        return retained

    def _read_log(self, final: bool = False) -> None:
        """Count warnings; an ERROR or a traceback is a failure (its first and last line), in
        the server's log and the relay's."""
        tails = [(self.log_tail, "server error", "server-log")]
        if self.relay is not None:
            tails.append((self.relay_log, "relay", "relay-log"))
        for tail, category, source in tails:
            for entry in tail.entries(final):
                problems = {m.group(1) or "Traceback" for m in map(soak._LOG_PROBLEM.search, entry) if m}
                if "WARNING" in problems:
                    if tail is self.log_tail:
                        self.result.server_log_warnings += 1
                    else:
                        self.result.relay_log_warnings += 1
                elif problems:  # ERROR, CRITICAL, or a traceback that was not logged as a warning
                    last = f" ... {entry[-1].strip()[:200]}" if len(entry) > 1 else ""
                    self.state.fail(category, source, entry[0].strip()[:300] + last)

    def _stop_server(self) -> None:
        process = self.server.process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # in case a stop fault was cut short
        try:
            self.result.server_exit_code = self.server.stop(timeout=30)
        except Exception:
            self.server.kill()
        self._read_log(final=True)

    def _check_server(self) -> None:
        process = self.server.process
        if self.expect_exit or process is None or process.poll() is None:
            return
        code = process.returncode
        name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
        last = (self.server.log().splitlines() or [""])[-1]
        self.state.fail(
            "crash", "server", f"the server exited with {code}{name} unasked; its last log line: {last[:200]}"
        )
        self.state.disrupted = True
        try:
            self._restart(self.state.current, "crash")
        finally:
            self.state.disrupted_until = time.monotonic()
            self.state.disrupted = False

    def _pause(self, seconds: float, check_server: bool = True) -> None:
        """Sleep, watching for a server that died, reading its log and printing progress."""
        until = time.monotonic() + seconds
        while not self.interrupt.is_set():
            if check_server:
                self._check_server()
            self._read_log()
            now = time.monotonic()
            if now >= self.next_progress:
                self.next_progress += self.config.progress_interval
                self.on_progress(self._progress_line())
            if now >= until:
                return
            time.sleep(min(TICK, until - now))

    def _progress_line(self) -> str:
        state = self.state
        lasts = [w.last() for w in self.watchers] or [0]
        return (
            f"chaos t={state.elapsed():5.0f}s faults={len(state.faults)} acked=v{state.acked_max} "
            f"fetches={sum(f.counts.total for f in self.fetchers)} watchers at v{min(lasts)}..v{max(lasts)} "
            f"failures={sum(state.failure_counts.values())} now={state.fault_label()}"
        )

    # ------------------------------------------------------------------ recovery and end
    def _recover(self, record: FaultRecord) -> None:
        """Wait until the publisher, every fetcher and every watcher worked after the fault."""
        assert self.publisher is not None
        ended = time.monotonic()
        limit = ended + self.config.recovery_seconds
        while not self.interrupt.is_set():
            missing = [] if self.publisher.last_acked_attempt >= ended else ["a publish acknowledged"]
            missing += [f.name for f in self.fetchers if f.last_ok_started < ended]
            if not missing:
                target = self.state.acked_max
                missing = [f"{w.name} at v{w.last()} < v{target}" for w in self.watchers if w.last() < target]
            if not missing and self.relay_client is not None:
                relayed = self._relay_latest()
                missing = [] if relayed >= target else [f"the relay at v{relayed} < v{target}"]
            if not missing:
                record.recovered_after = round(time.monotonic() - ended, 3)
                return
            if time.monotonic() > limit:
                self.state.fail(
                    "no recovery",
                    "chaos",
                    f"not recovered {self.config.recovery_seconds:g}s after the fault: {', '.join(missing[:6])}",
                )
                return
            self._pause(0.05)

    def _relay_latest(self) -> int:
        """The newest version of the load's model the relay holds (0: none, or no answer)."""
        try:
            with self.watchdog.call("chaos", "relay latest", self.config.deadline):
                return self.relay_client.latest(MODEL).version
        except Exception:
            return 0

    def _wind_down(self) -> None:
        """Stop the publisher and fetchers, let the watchers catch up, close the streams."""
        state, config = self.state, self.config
        state.stop.set()
        join = config.deadline + config.slack + 5
        threads = [self.publisher.thread] if self.publisher is not None else []
        threads += [f.thread for f in self.fetchers]
        until = time.monotonic() + join
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))
            if thread.is_alive():
                state.fail("hang", thread.name, f"did not stop within {join:g}s")
        final = state.acked_max
        until = time.monotonic() + config.deadline + config.slack
        for watcher in self.watchers:
            watcher.wait_for(final, max(0.0, until - time.monotonic()))
        self._close_clients()

    def _close_clients(self) -> None:
        """Close the load's clients (once); the watch streams end on purpose now."""
        self.state.closing.set()
        clients = [*self.watch_clients, *(f.client for f in self.fetchers)]
        clients += [self.publisher.client] if self.publisher is not None else []
        if self.clients_closed:
            return
        self.clients_closed = True
        for client in clients:
            client.close()
        for watcher in self.watchers:
            if watcher.thread.ident is not None:
                watcher.thread.join(5)

    def _final_audit(self) -> None:
        """Restart gracefully, then every retained version must match what was published, and
        every watcher's sequence must miss nothing without a gap flag."""
        state = self.state
        state.current, state.phase = None, "final-audit"
        code = self.server.stop(timeout=30)
        if code != 0:
            state.fail("crash", "server", f"exit code {code} after SIGTERM (expected 0)")
        self._restart(None, "graceful stop")
        retained = self._check_retained("at the end")
        self.result.retained_at_end = retained
        for version in retained:
            try:
                with self.watchdog.call("chaos", "audit fetch", self.config.deadline):
                    fetched = self.admin.fetch_bytes(
                        MODEL, version=version, transport="stream", timeout=self.config.deadline
                    )
            except Exception as exc:
                state.fail("lost version", "audit", f"fetch of retained v{version} failed: {type(exc).__name__}: {exc}")
                continue
            seq = int(fetched.info.metadata.get("seq", "-1"))
            if hashlib.sha256(fetched.data).hexdigest() != state.sha256.get(seq):
                state.fail("bad read", "audit", f"v{version}: the bytes differ from those published as seq {seq}")
        committed = sorted(state.version_seqs)
        for watcher in self.watchers:
            versions, flags = watcher.versions, watcher.flags
            for i in range(1, len(versions)):
                skipped = [c for c in committed if versions[i - 1] < c < versions[i]]
                if skipped and not flags[i]:
                    state.fail(
                        "watch",
                        watcher.name,
                        f"missed {_vs(skipped)} before v{versions[i]}, which was not flagged as a gap",
                    )
            if watcher.last() < state.acked_max:
                state.fail("watch", watcher.name, f"ended at v{watcher.last()}, v{state.acked_max} was acknowledged")
        if self.relay_client is not None:
            self._audit_relay()

    def _audit_relay(self) -> None:
        """The relay follows the restarted server to the last acknowledged version and serves
        no version deleted on it."""
        state, config = self.state, self.config
        final = state.acked_max
        if not self._relay_until(lambda: self._relay_latest() >= final, time.monotonic() + config.recovery_seconds):
            state.fail("relay", "relay", f"at v{self._relay_latest()} at the end, v{final} was acknowledged")
        for model in sorted({m for m, _ in state.deleted}):
            try:
                served = sorted(set(self._relay_holds(model)) & {v for m, v in state.deleted if m == model})
            except Exception as exc:
                state.fail("relay", "relay", f"at the end: list_versions failed: {type(exc).__name__}: {exc}")
                continue
            if served:
                state.fail("relay", "relay", f"at the end, still serves {model} {_vs(served)}, deleted on the primary")

    def _summarise(self) -> None:
        state, result = self.state, self.result
        result.interrupted = self.interrupt.is_set()
        result.faults = [asdict(f) for f in state.faults]
        result.acked_versions = sorted(state.acked)
        if self.publisher is not None:
            result.publish_attempts = self.publisher.attempts
            result.publish_retries = self.publisher.retries
        acked = set(state.acked)
        result.unacknowledged_committed = sorted(set(state.version_seqs) - acked)
        for fetcher in self.fetchers:
            result.fetches += fetcher.counts.total
            result.evicted_retries += fetcher.counts.evicted_retries
            for name, count in fetcher.counts.transports.items():
                key = f"{fetcher.transport}->{name}"
                result.fetch_transports[key] = result.fetch_transports.get(key, 0) + count
        result.calls = self.watchdog.calls
        result.longest_call = dict(sorted(self.watchdog.longest.items()))
        result.tolerated_errors = sum(sum(f.tolerated.values()) for f in state.faults)
        result.gaps = state.gaps
        result.watchers = [
            {"name": w.name, "seen": len(w.versions), "gaps": w.gaps, "ended": w.ended, "versions": w.versions}
            for w in self.watchers
        ]
        result.failure_counts = {c: state.failure_counts.get(c, 0) for c in CATEGORIES}
        result.failures = [asdict(f) for f in state.failures]
        result.ok = not result.interrupted and not result.aborted and not any(result.failure_counts.values())


def run_chaos(
    config: ChaosConfig, on_progress: Callable[[str], None] = log, interrupt: threading.Event | None = None
) -> ChaosResult:
    """One chaos run against a fresh server process (see the module docstring)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Chaos(config, interrupt or threading.Event(), on_progress).run()
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------- report
def format_summary(result: ChaosResult) -> str:
    c = result.config
    rows: list[tuple[str, str]] = []

    def row(name: str, value: str) -> None:
        rows.append((name, value))

    row(
        "setup",
        f"{c['watchers']} watchers, {c['fetchers']} fetchers ({', '.join(c['transports'])}), publish every "
        f"{c['publish_interval']:g}s, model {format_size(c['model_bytes'])}, --keep {c['keep']}, "
        f"deadline {c['deadline']:g}s + slack {c['slack']:g}s, seed {result.seed}",
    )
    row("duration", f"{result.duration:.1f} s" + (" (interrupted)" if result.interrupted else ""))
    row(
        "publish id",
        "yes (retries reuse it)"
        if result.publish_id
        else "NO: this client has no publish id, retries can commit twice",
    )
    by_name: dict[str, list[dict[str, Any]]] = {}
    for fault in result.faults:
        by_name.setdefault(fault["name"], []).append(fault)
    for name in FAULTS:
        if name in result.skipped:
            row(f"fault {name}", f"skipped: {result.skipped[name]}")
            continue
        runs = by_name.get(name, [])
        if not runs:
            row(f"fault {name}", "not run" if name in c["faults"] else "not selected")
            continue
        recovered = [f["recovered_after"] for f in runs if f["recovered_after"] is not None]
        tolerated: Counter[str] = Counter()
        for f in runs:
            tolerated.update(f["tolerated"])
        text = f"{len(runs)} run(s), {sum(f['failures'] for f in runs)} failure(s)"
        if recovered:
            text += f", recovered in <= {max(recovered):.1f}s"
        if len(recovered) < len(runs):
            text += f" ({len(runs) - len(recovered)} never)"
        text += _fault_note(name, runs)
        if tolerated:
            text += "; tolerated errors: " + ", ".join(f"{k} {v}" for k, v in tolerated.most_common(4))
        row(f"fault {name}", text)
    acked = result.acked_versions
    row(
        "versions acknowledged",
        f"{len(acked)}"
        + (f" (v{acked[0]}..v{acked[-1]})" if acked else "")
        + f"; {result.publish_retries} retried publish(es); committed but never acknowledged: "
        + (_vs(result.unacknowledged_committed[:10]) or "none"),
    )
    row("retained at the end", _vs(result.retained_at_end) or "-")
    row("server restarts", f"{result.server_restarts}; exit code at the end {result.server_exit_code}")
    row(
        "fetches",
        f"{result.fetches}; by transport (asked->used) "
        + ", ".join(f"{k} {v}" for k, v in sorted(result.fetch_transports.items()))
        + f"; evicted retries {result.evicted_retries}",
    )
    row(
        "calls watched",
        f"{result.calls}; longest: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.longest_call.items()),
    )
    restarts = sum(1 for g in result.gaps if g["across_restart"])
    row("flagged watch gaps", f"{len(result.gaps)} ({restarts} across restarts, {len(result.gaps) - restarts} other)")
    row("server log", f"{result.server_log_warnings} warnings")
    if "delete" in c["faults"]:
        row("relay", f"{result.relay_log_warnings} warnings in its log; exit code at the end {result.relay_exit_code}")
    row("failures", ", ".join(f"{k} {v}" for k, v in result.failure_counts.items()))
    verdict = "PASS" if result.ok else "INTERRUPTED" if result.interrupted else "FAIL"
    row("result", verdict + (f" (aborted: {result.aborted})" if result.aborted else ""))
    width = max(len(name) for name, _ in rows)
    lines = ["", "chaos summary", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    if result.failures:
        total = sum(result.failure_counts.values())
        lines += ["", f"failures ({total}, first {len(result.failures)}):"]
        lines += [
            f"  [{f['t']:8.2f}s] {f['category']} {f['fault']} {f['source']}: {f['message']}" for f in result.failures
        ]
    return "\n".join(lines)


def _fault_note(name: str, runs: list[dict[str, Any]]) -> str:
    details = [f["details"] for f in runs]
    if name == "stop":
        return f"; {sum(1 for d in details if d.get('outlasts_deadline'))} outlasting the deadline"
    if name in ROOT_FAULTS:
        return f"; ballast up to {format_size(max((d.get('ballast_bytes', 0) for d in details), default=0))}"
    if name == "flood-bulk":
        return f"; {max((d.get('connections', 0) for d in details), default=0)} connections"
    if name == "drop-reply":
        fired = [d for d in details if d.get("fired")]
        landed = sum(1 for d in fired if d.get("committed_before_reply_lost"))
        return f"; {len(fired)} reply(ies) dropped, {landed} after the commit landed"
    if name == "kill":
        seconds = [d["restart_seconds"] for d in details if "restart_seconds" in d]
        return f"; restart took <= {max(seconds):.1f}s" if seconds else ""
    if name == "stall-publish":
        reopens = sum(1 for d in details if d.get("mode") == "reopen")
        fetches = sum(d.get("fetches_during", 0) for d in details)
        return f"; {reopens} run(s) reopening every 0.3 s, {fetches} fetch(es) completed meanwhile"
    if name == "rewrite-upload":
        before = [d for d in details if d.get("when") == "before"]
        refused = sum(1 for d in before if d.get("refused"))
        after = sum(1 for d in details if d.get("when") == "after" and d.get("version"))
        return f"; {refused}/{len(before)} changed before `uploaded` refused, {after} changed after the commit"
    if name == "delete":
        deleted = sum(len(d.get("deleted", [])) for d in details)
        dropped = [d["relay_dropped_after"] for d in details if "relay_dropped_after" in d]
        every = sum(1 for d in details if d.get("every_side_version"))
        text = f"; {deleted} version(s) deleted ({every} run(s) deleting every version of {SIDE_MODEL})"
        return text + (f", the relay dropped them in <= {max(dropped):.1f}s" if dropped else "")
    return ""


# ---------------------------------------------------------------------- command line
def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


# Options named as ChaosConfig's fields: (field, type, help); the default is the config's.
_OPTIONS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("seconds", float, "how long faults are injected"),
    ("rounds", int, "at least this many rounds of every fault (each once, in random order), past --seconds if need be"),
    ("seed", int, "random seed; drawn and reported when not given"),
    ("deadline", float, "deadline of every call, seconds"),
    ("slack", float, "how far past its deadline a call is a hang, seconds"),
    ("faults", _names, "faults to inject, comma-separated"),
    ("hold", _range, "MIN,MAX seconds a fault lasts"),
    ("quiet", _range, "MIN,MAX seconds between a recovery and the next fault"),
    ("recovery", float, "seconds everything gets to work again after a fault (0: 2 x (deadline + slack))"),
    ("watchers", int, "Watch streams"),
    ("fetchers", int, "fetcher threads"),
    ("transports", _names, "fetch transports, assigned in turn (auto is shared memory here)"),
    ("publish_interval", float, "seconds between publishes"),
    ("model_bytes", parse_size, "size of the published model"),
    ("keep", int, "server --keep"),
    ("tmpfs_bytes", parse_size, "size of each tmpfs mount (shm, data)"),
    ("flood_connections", int, "idle connections a bulk flood opens"),
    ("relay_poll", float, "the relay's --upstream-poll, seconds (with the delete fault)"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = ChaosConfig()
    for name, kind, text in _OPTIONS:
        default = getattr(defaults, name)
        shown = (
            format_size(default)
            if name.endswith("_bytes")
            else ",".join(map(str, default))
            if isinstance(default, tuple)
            else default
        )
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, type=kind, default=default, help=f"{text} (default: {shown})")
    parser.add_argument(
        "--server-arg", dest="server_args", action="append", default=[], help="extra `weightserver serve` argument"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the whole result to this file")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    values = {name: getattr(args, name) for name, _, _ in _OPTIONS}
    return ChaosConfig(**values, server_args=tuple(args.server_args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    # The client logs a warning for every retry; under faults they are expected (and counted).
    # Restored after: a test that runs this in process must not silence the client for the next.
    client_log = logging.getLogger("weightclient")
    level = client_log.level
    client_log.setLevel(logging.ERROR)
    try:
        return soak.run_from_command_line(lambda stop: run_chaos(config, interrupt=stop), format_summary, args.json)
    finally:
        client_log.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
