"""Collector process: a torchrl `Collector` on PendulumEnv whose policy follows the server.

Before each batch, `collector.update_policy_weights_()` asks the weight server for a version
newer than the one applied (`GrpcWeightSyncScheme`: nothing moves when up to date) and
every frame is stamped with the server version that produced it (`ServerPolicyVersion`). Each
batch goes to the trainer through the spool. The collector waits while the spool already holds
`--spool-max-batches` unconsumed batches, so it never runs far ahead of the trainer, and the
weights it pulls just before collecting are fresh.

It stops when the trainer writes STOP (after one last pull, so it ends on the trainer's final
version), on SIGTERM/SIGINT, or at a fallback deadline if the trainer never shows up; it then
writes its report into the spool and waits for the trainer to finish.

    python -m demo.collector --server localhost:50051 --spool-dir /tmp/spool
"""

from __future__ import annotations

import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from demo import config
from demo.lifecycle import StopRequest, run_role
from demo.models import COLLECTOR_KEY_MAP, SPOOL_KEYS, make_env, make_exploring_policy
from demo.output import Every, quiet_torchrl, say
from demo.spool import Spool, SpoolSession
from weightserver.protocol.errors import Cancelled, DeadlineExceeded

WAIT = 0.02  # seconds between spool checks while waiting
# How long a collector keeps pulling for the trainer's final version after STOP: through a
# relay it lands a moment after the trainer's publish returned.
FINAL_WAIT = 10.0


@dataclass
class CollectorStats:
    """What this collector did, for its progress line and its final report."""

    name: str
    started: float = field(default_factory=time.monotonic)
    frames: int = 0
    batches: int = 0
    applied: list[int] = field(default_factory=list)  # versions applied, in order
    # [version, time.monotonic()] as each was applied: the trainer, on this host, knows when it
    # called publish for each version (same clock), and reports the freshness
    applied_at: list[list[float]] = field(default_factory=list)
    fetched_bytes: int = 0
    transports: dict[str, int] = field(default_factory=dict)
    # [time.monotonic(), server latest - applied] after each batch (the summary's timeline)
    lag_at: list[list[float]] = field(default_factory=list)
    episode_rewards: list[float] = field(default_factory=list)
    waited_seconds: float = 0.0  # waiting for the trainer to consume

    def after_update(self, updater: Any) -> None:
        now = time.monotonic()  # right after the update: the policy holds `version`
        version = updater.version
        if version is not None and (not self.applied or self.applied[-1] != version):
            self.applied.append(version)
            self.applied_at.append([version, now])
            stats = updater.puller.last_fetch
            if stats is not None:
                self.fetched_bytes += stats.wire_bytes
                self.transports[stats.transport] = self.transports.get(stats.transport, 0) + 1

    def after_batch(self, batch: Any, lag: int | None) -> None:
        self.frames += batch.numel()
        self.batches += 1
        if lag is not None:
            self.lag_at.append([round(time.monotonic(), 3), lag])
        done = batch["next", "done"].reshape(-1)
        self.episode_rewards += batch["next", "episode_reward"].reshape(-1)[done].tolist()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        version = f"v{self.applied[-1]}" if self.applied else "no version yet"
        lag = self.lag_at[-1][1] if self.lag_at else "-"
        reward = f"{self.episode_rewards[-1]:.0f}" if self.episode_rewards else "-"
        return (
            f"{elapsed:5.0f}s  applied {version} (lag {lag}, {len(self.applied)} versions, "
            f"{self.fetched_bytes / 1e3:.0f} kB)  frames {self.frames} ({self.frames / max(elapsed, 1e-9):.0f}/s)  "
            f"episodes {len(self.episode_rewards)}, last reward {reward}"
        )

    def report(self, reason: str) -> dict[str, Any]:
        lags = [lag for _, lag in self.lag_at]
        return {
            "name": self.name,
            "frames": self.frames,
            "batches": self.batches,
            "versions_applied": len(self.applied),
            "first_version": self.applied[0] if self.applied else None,
            "final_version": self.applied[-1] if self.applied else None,
            "applied_at": self.applied_at,
            "fetched_bytes": self.fetched_bytes,
            "transports": self.transports,
            "max_lag": max(lags, default=None),
            "mean_lag": sum(lags) / len(lags) if lags else None,
            "lag_at": self.lag_at,
            "episodes": len(self.episode_rewards),
            "waited_seconds": round(self.waited_seconds, 2),
            "seconds": round(time.monotonic() - self.started, 2),
            "stopped_by": reason,
        }


def collector_seed(seed: int, name: str) -> int:
    """A seed of its own for each collector, stable for a given name."""
    return seed + 1 + zlib.crc32(name.encode()) % 100_000


def make_collector(args: Any, seed: int) -> tuple[Any, Any]:
    quiet_torchrl()
    from torchrl.collectors import Collector

    from weightclient.torchrl.scheme import GrpcWeightSyncScheme, ServerPolicyVersion

    scheme = GrpcWeightSyncScheme(args.server, model=args.model, key_map=COLLECTOR_KEY_MAP)
    collector = Collector(
        make_env(seed),
        make_exploring_policy(args.hidden, args.noise),
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        init_random_frames=args.random_frames,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=ServerPolicyVersion(),
        auto_register_policy_transforms=False,
    )
    return collector, scheme


def pull(collector: Any, name: str) -> None:
    """Apply the server's newer version, if any. The updater itself rides out an unavailable
    server; a call cut short while the server shuts down keeps the current weights too."""
    try:
        collector.update_policy_weights_()
    except (Cancelled, DeadlineExceeded) as exc:
        say(name, f"weight update skipped ({type(exc).__name__}): keeping the current weights")


def pull_final(collector: Any, scheme: Any, stats: CollectorStats, name: str, final: int | None, stop: Any) -> None:
    """Pull the trainer's final version. From a relay (or with a version still on its way) it
    may not be there at the first pull, so pull until it is applied, for at most FINAL_WAIT
    seconds; `final` None (no STOP, or no version): pull once."""
    deadline = time.monotonic() + FINAL_WAIT
    while True:
        pull(collector, name)
        stats.after_update(scheme)
        if final is None or (scheme.version or 0) >= final or stop or time.monotonic() >= deadline:
            return
        stop.wait(0.05)


def lag_of(updater: Any) -> int | None:
    try:
        return updater.lag
    except (Cancelled, DeadlineExceeded):
        return None


def still_current(spool: Spool, session: SpoolSession) -> bool:
    current = spool.current_session()
    return current is not None and current.id == session.id


def join_session(spool: Spool, stop: StopRequest, deadline: float) -> SpoolSession | None:
    """Wait for the trainer to announce a session that is still open."""
    while not stop and time.monotonic() < deadline:
        session = spool.current_session()
        if session is not None and not session.stopped():
            return session
        stop.wait(0.2)
    return None


def run(args: Any, stop: StopRequest) -> int:
    torch.set_num_threads(args.torch_threads)
    name = args.collector_id
    seed = collector_seed(args.seed, name)
    torch.manual_seed(seed)
    spool = Spool(args.spool_dir)
    # Fallback only: normally the trainer's STOP ends the collection.
    deadline = time.monotonic() + args.seconds + args.drain_timeout + 60
    stats = CollectorStats(name)
    say(name, f"starting: server {args.server}, spool {args.spool_dir}, seed {seed}")
    collector, scheme = make_collector(args, seed)
    session = join_session(spool, stop, deadline)
    reason = "deadline"
    progress = Every(args.progress_seconds)
    try:
        batches = iter(collector)
        while session is not None and not stop and time.monotonic() < deadline:
            if session.stopped():
                reason = "trainer"
                break
            if session.pending() >= args.spool_max_batches:
                t0 = time.monotonic()
                stop.wait(WAIT)
                stats.waited_seconds += time.monotonic() - t0
                continue
            pull(collector, name)
            stats.after_update(scheme)
            batch = next(batches)
            lag = lag_of(scheme)
            try:
                session.put(batch.select(*SPOOL_KEYS), f"{time.time_ns():020d}-{name}-{stats.batches:06d}")
            except Exception:
                if still_current(spool, session):
                    raise
                # The trainer replaced the session (a new run on a persistent spool): join it.
                session = join_session(spool, stop, deadline)
                continue
            stats.after_batch(batch, lag)
            if progress.due():
                say(name, stats.line())
        if stop:
            reason = stop.signal_name or "signal"
        final = session.final_version() if reason == "trainer" and session is not None else None
        pull_final(collector, scheme, stats, name, final, stop)
    finally:
        collector.shutdown()
    say(name, stats.line())
    if session is None:
        say(name, f"no open spool session in {args.spool_dir}; nothing to report")
        return 0 if stop else 1
    session.write_report(name, stats.report(reason))
    # Stay until the trainer consumed everything (compose stops all services when it exits).
    signalled = bool(stop)
    wait_until = time.monotonic() + (10 if signalled else args.drain_timeout + 30)
    while not session.finished() and time.monotonic() < wait_until and still_current(spool, session):
        if signalled:
            time.sleep(0.2)
        elif stop.wait(0.2):  # stopped while it waits: leave now (a stop kills it 10 s after the signal)
            reason = stop.signal_name or "signal"
            break
    final = f"v{stats.applied[-1]}" if stats.applied else "none"
    say(name, f"done ({reason}): {stats.frames} frames, final version {final}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_role(run, argv, config.COLLECTOR_OPTIONS, "python -m demo.collector", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
