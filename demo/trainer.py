"""Trainer process: DDPG (torchrl.objectives.DDPGLoss) on the collectors' Pendulum experience.

Batches arrive through the spool and go into a torchrl ReplayBuffer; every optimisation step
samples from it. The actor is published to the weight server through `PublishWeights` (our
trainer hook, driving a `GrpcRemoteWeightUpdater`) every `--publish-every` steps, and once
at start so that collectors have a version from the first batch on. The trainer takes a
batch from the spool whenever it has done `--updates-per-frame` steps per frame taken so far;
collectors wait while the spool is full, so data and training stay in step.

`--seconds` count from the first batch it takes: collectors that take long to start (8 containers
on a small machine) leave the training time as it is; with no batch in `--drain-timeout` the
trainer gives up. After them (or SIGTERM/SIGINT) it publishes a final version, writes STOP, keeps
consuming until every collector reported (or `--drain-timeout`), checks the spool is empty,
prints the summary and writes it to `--summary-json` (with a timeline of episode rewards,
collector lag and freshness, which `python -m demo` plots).

    python -m demo.trainer --server localhost:50051 --spool-dir /tmp/spool --seconds 150
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from demo import config
from demo.jsonfile import write_json_atomic
from demo.lifecycle import StopRequest, run_role
from demo.models import make_actor, make_critic
from demo.output import Every, quiet_torchrl, say
from demo.spool import Spool
from demo.summary import collector_totals, format_summary, freshness, reward_trend, timeline


class Learner:
    """DDPG: actor, critic, target critic, one Adam, a replay buffer."""

    def __init__(self, args: Any) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.objectives import DDPGLoss, SoftUpdate

        torch.manual_seed(args.seed)
        self.actor = make_actor(args.hidden)
        self.loss = DDPGLoss(actor_network=self.actor, value_network=make_critic(args.hidden))
        self.loss.make_value_estimator(gamma=args.gamma)
        self.target = SoftUpdate(self.loss, tau=args.tau)
        # The actor loss sees the critic's parameters detached, so one optimizer on the summed
        # loss steps the actor by the actor loss and the critic by the value loss.
        self.optimizer = torch.optim.Adam(self.loss.parameters(), lr=args.lr)
        self.buffer = ReplayBuffer(storage=LazyTensorStorage(args.replay_size), batch_size=args.batch_size)
        self.steps = 0

    def add(self, batch: Any) -> None:
        self.buffer.extend(batch)

    def step(self) -> None:
        losses = self.loss(self.buffer.sample())
        self.optimizer.zero_grad()
        (losses["loss_actor"] + losses["loss_value"]).backward()
        self.optimizer.step()
        self.target.step()
        self.steps += 1


class TrainerStats:
    """Counts for the progress line and the summary."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.frames = 0
        self.batches = 0
        self.staleness: list[int] = []  # latest published - oldest version in a consumed batch
        self.episode_rewards: list[float] = []
        self.episode_at: list[float] = []  # time.monotonic() when each episode's batch was taken

    def consumed(self, batch: Any, latest: int | None, first: int | None) -> None:
        self.frames += batch.numel()
        self.batches += 1
        oldest = int(batch["next", "policy_version"].min())
        if latest is not None and first is not None and oldest >= first:  # not random warm-up or older runs
            self.staleness.append(latest - oldest)
        done = batch["next", "done"].reshape(-1)
        rewards = batch["next", "episode_reward"].reshape(-1)[done].tolist()
        self.episode_rewards += rewards
        self.episode_at += [time.monotonic()] * len(rewards)

    def episodes(self) -> list[tuple[float, float]]:
        """(time the trainer took the batch, episode reward) of every episode that ended."""
        return list(zip(self.episode_at, self.episode_rewards, strict=True))

    def staleness_summary(self) -> dict[str, float | None]:
        values = self.staleness
        return {"max": max(values, default=None), "mean": round(sum(values) / len(values), 3) if values else None}

    def line(self, steps: int, version: int | None) -> str:
        elapsed = time.monotonic() - self.started
        recent = self.episode_rewards[-10:]
        reward = f"{sum(recent) / len(recent):.0f}" if recent else "-"
        stale = self.staleness[-1] if self.staleness else "-"
        return (
            f"{elapsed:5.0f}s  published v{version}  steps {steps} ({steps / max(elapsed, 1e-9):.0f}/s)  "
            f"consumed {self.frames} frames in {self.batches} batches (data age {stale})  "
            f"episode reward (last 10) {reward}"
        )


class Trainer:
    """The trainer process: learner, publisher, spool session, statistics."""

    def __init__(self, args: Any, stop: StopRequest) -> None:
        from weightclient.torchrl.grpc_updaters import GrpcRemoteWeightUpdater
        from weightclient.torchrl.publish_hook import PublishWeights

        self.args, self.stop = args, stop
        self.learner = Learner(args)
        self.stats = TrainerStats()
        self.publisher = GrpcRemoteWeightUpdater(
            args.server,
            self.learner.actor,
            models=[args.model],
            metadata=lambda: {"steps": str(self.learner.steps), "frames": str(self.stats.frames)},
        )
        self.hook = PublishWeights(self.publisher, args.publish_every)
        self.session = Spool(args.spool_dir).open_session()
        self.first_version: int | None = None
        # version -> time.monotonic() of the publish call that made it; collectors on this
        # host stamp their applications with the same clock (CLOCK_MONOTONIC is system-wide)
        self.published_at: dict[int, float] = {}

    def publish(self, now: bool = False) -> int | None:
        """The hook's publish (every `publish_every` steps; at once with `now`), noting when
        it was called under the version it made, for the summary's freshness."""
        called, count = time.monotonic(), len(self.hook.published)
        if now:
            self.hook.publish()
        else:
            self.hook()
        if len(self.hook.published) > count:
            self.published_at[self.hook.published[-1]] = called
            return self.hook.published[-1]
        return None

    def start(self) -> None:
        say(
            "trainer",
            f"starting: server {self.args.server}, spool {self.session.dir}, training {self.args.seconds:.0f}s",
        )
        self.publisher.client.list_models()  # waits while the server is unavailable (client retries, 30 s)
        self.first_version = self.publish(now=True)  # collectors get a version of this run from their first batch

    def first_batch(self) -> float | None:
        """Take the collectors' first batch: when it was taken, or None after `--drain-timeout`
        without one (or a stop). The training clock starts here, not at the trainer's start."""
        until = time.monotonic() + self.args.drain_timeout
        while not self.stop:
            ready = self.session.ready()
            if ready:
                self.consume(ready[0])
                return time.monotonic()
            if time.monotonic() >= until:
                waited = f"{self.args.drain_timeout:.0f}s (--drain-timeout)"
                say("trainer", f"no collector sent a batch in {waited}: winding down")
                return None
            self.stop.wait(0.01)
        return None

    def consume(self, path: Path) -> None:
        batch = self.session.take(path)
        self.stats.consumed(batch, self.publisher.version, self.first_version)
        self.learner.add(batch)

    def train(self) -> float:
        """Train until `--seconds` have passed since the first batch, or a stop is requested;
        returns the seconds trained (0 when no batch came within `--drain-timeout`).

        A spool batch is taken whenever the learner is "hungry" (it has done
        `--updates-per-frame` steps per frame taken since the warm-up), so the collectors, which
        wait while the spool is full, produce only as fast as the trainer learns."""
        args, learner, stats = self.args, self.learner, self.stats
        started = self.first_batch()
        if started is None:
            return 0.0
        progress = Every(args.progress_seconds)
        while not self.stop and time.monotonic() < started + args.seconds:
            warming = len(learner.buffer) < args.warmup_frames
            hungry = learner.steps >= args.updates_per_frame * max(0, stats.frames - args.warmup_frames)
            if warming or hungry:
                ready = self.session.ready()
                if ready:
                    self.consume(ready[0])
                    continue
                if warming:
                    self.stop.wait(0.01)
                    continue
            learner.step()
            self.publish()  # PublishWeights: publishes every `publish_every` steps
            if progress.due():
                say("trainer", stats.line(learner.steps, self.publisher.version))
        say("trainer", stats.line(learner.steps, self.publisher.version))
        return time.monotonic() - started

    def wind_down(self) -> tuple[int | None, dict[str, dict[str, Any]]]:
        """Publish the final version, tell the collectors to stop, take what they still send."""
        try:
            final = self.publish(now=True)
        except Exception as exc:  # e.g. the server is already gone after a Ctrl-C
            say("trainer", f"final publish failed: {exc}")
            final = self.publisher.version
        self.session.stop(final)
        say("trainer", f"final version v{final}; STOP written, waiting for {self.args.collectors} collector reports")
        # Stopped by a signal, the collectors got one too and report at once; compose allows 10 s.
        timeout = min(self.args.drain_timeout, 8) if self.stop else self.args.drain_timeout
        reports = self.drain(timeout)
        if len(reports) >= self.args.collectors:
            self.session.remove_incoming()  # debris of a collector that died mid-write, if any
        return final, reports

    def drain(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Consume batches until every collector reported, then whatever they wrote last."""
        until = time.monotonic() + timeout
        reports = self.session.reports()
        while len(reports) < self.args.collectors and time.monotonic() < until:
            ready = self.session.ready()
            for path in ready:
                self.consume(path)
            if not ready:
                time.sleep(0.05)
            reports = self.session.reports()
        for path in self.session.ready():
            self.consume(path)
        if len(reports) < self.args.collectors:
            say("trainer", f"only {len(reports)} of {self.args.collectors} collectors reported")
        return reports

    def summary(self, train_seconds: float, final: int | None, reports: dict[str, Any]) -> dict[str, Any]:
        leftovers = self.session.leftovers()
        return {
            "train_seconds": round(train_seconds, 1),
            "seconds": round(time.monotonic() - self.stats.started, 1),
            "stopped_by": self.stop.signal_name or "deadline",
            "updates": self.learner.steps,
            "publish_every": self.args.publish_every,
            "versions_published": len(self.hook.published),
            "first_version": self.first_version,
            "final_version": final,
            "frames_consumed": self.stats.frames,
            "batches_consumed": self.stats.batches,
            "staleness": self.stats.staleness_summary(),
            "collectors_expected": self.args.collectors,
            "collectors": reports,
            **collector_totals(reports),
            "freshness": freshness(self.published_at, reports),
            "timeline": timeline(self.stats.started, self.stats.episodes(), self.published_at, reports),
            "reward": reward_trend(self.stats.episode_rewards),
            "spool_leftovers": leftovers,
            "spool_empty": not leftovers,
            "settings": {name: getattr(self.args, name) for name in config.TRAINER_OPTIONS},
        }


def run(args: Any, stop: StopRequest) -> int:
    torch.set_num_threads(args.torch_threads)
    quiet_torchrl()
    trainer = Trainer(args, stop)
    trainer.start()
    train_seconds = trainer.train()
    final, reports = trainer.wind_down()
    summary = trainer.summary(train_seconds, final, reports)
    if args.summary_json:
        write_json_atomic(Path(args.summary_json), summary)
    print(format_summary(summary), flush=True)
    trainer.session.finish()
    # Non-zero when experience went missing: a collector never reported, or batches were left.
    return 0 if len(reports) >= args.collectors and summary["spool_empty"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_role(run, argv, config.TRAINER_OPTIONS, "python -m demo.trainer", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
