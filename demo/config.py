"""Every setting of the demo: a flag, an environment variable and a default.

A flag beats its environment variable, which beats the default. The orchestrator
(`python -m demo`) hands its settings to the trainer and collector processes as environment
variables, exactly as `docker/compose.yaml` configures the same processes.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One setting: `--name` on the command line, `env` in the environment."""

    name: str
    env: str
    type: Callable[[str], Any]
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _default_collector_id() -> str:
    # Compose replicas share their environment; their host names (container ids) differ.
    return f"{socket.gethostname()}-{os.getpid()}"


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option("server", "WEIGHTSERVER_ADDRESS", str, "localhost:50051", "weight server address, host:port"),
        Option("model", "DEMO_MODEL", str, "policy", "model name the policy is published under"),
        Option("seconds", "DEMO_SECONDS", float, 120.0, "seconds of training (from the first batch)"),
        Option("spool_dir", "DEMO_SPOOL_DIR", str, None, "directory the collectors' batches travel through"),
        Option("collectors", "DEMO_COLLECTORS", int, 2, "collector processes (the trainer waits for their reports)"),
        Option("frames_per_batch", "DEMO_FRAMES_PER_BATCH", int, 100, "frames per collector batch"),
        Option("publish_every", "DEMO_PUBLISH_EVERY", int, 50, "publish the policy every N optimisation steps"),
        Option("updates_per_frame", "DEMO_UPDATES_PER_FRAME", float, 1.0, "optimisation steps per collected frame"),
        Option("batch_size", "DEMO_BATCH_SIZE", int, 256, "replay sample size per optimisation step"),
        Option("warmup_frames", "DEMO_WARMUP_FRAMES", int, 1000, "frames in the replay buffer before training"),
        Option("random_frames", "DEMO_RANDOM_FRAMES", int, 500, "random-action frames at the start of each collector"),
        Option("replay_size", "DEMO_REPLAY_SIZE", int, 100_000, "replay buffer capacity in frames"),
        Option("hidden", "DEMO_HIDDEN", int, 64, "hidden units of the actor and critic MLPs"),
        Option("lr", "DEMO_LR", float, 1e-3, "Adam learning rate"),
        Option("gamma", "DEMO_GAMMA", float, 0.99, "discount"),
        Option("tau", "DEMO_TAU", float, 0.005, "target network soft-update rate"),
        Option("noise", "DEMO_NOISE", float, 0.2, "std of the Gaussian exploration noise (actions lie in [-2, 2])"),
        Option("seed", "DEMO_SEED", int, 0, "seed of the trainer; collectors add their own offset"),
        Option("spool_max_batches", "DEMO_SPOOL_MAX_BATCHES", int, 2, "collectors wait while this many are pending"),
        Option("drain_timeout", "DEMO_DRAIN_TIMEOUT", float, 60.0, "trainer: wait for a first batch, and reports"),
        Option("progress_seconds", "DEMO_PROGRESS_SECONDS", float, 5.0, "seconds between progress lines"),
        Option("torch_threads", "DEMO_TORCH_THREADS", int, 1, "torch intra-op threads per process"),
        Option("collector_id", "DEMO_COLLECTOR_ID", str, None, "this collector's name (default: host name and pid)"),
        Option("summary_json", "DEMO_SUMMARY_JSON", str, None, "write the summary as JSON to this file"),
        Option(
            "plot",
            "DEMO_PLOT",
            str,
            "auto",
            "PNG of episode reward, collector lag and freshness over time, drawn at the end (needs matplotlib): "
            "a file; auto: beside --summary-json (its name, .png), else demo.png here; none: no plot",
        ),
        Option("port", "DEMO_SERVER_PORT", int, 0, "port of the server the demo starts (0: a free one)"),
        Option("data_dir", "DEMO_DATA_DIR", str, None, "--data-dir of the server the demo starts (default: memory)"),
    ]
}

TRAINER_OPTIONS = [
    *("server", "model", "seconds", "spool_dir", "collectors", "publish_every", "updates_per_frame"),
    *("batch_size", "warmup_frames", "replay_size", "hidden", "lr", "gamma", "tau", "seed"),
    *("drain_timeout", "progress_seconds", "torch_threads", "summary_json"),
]
COLLECTOR_OPTIONS = [
    *("server", "model", "seconds", "spool_dir", "frames_per_batch", "random_frames", "hidden", "noise"),
    *("seed", "spool_max_batches", "drain_timeout", "progress_seconds", "torch_threads", "collector_id"),
]
RUN_OPTIONS = [name for name in OPTIONS if name not in ("server", "collector_id")]

_POSITIVE = {"seconds", "collectors", "frames_per_batch", "publish_every", "batch_size", "replay_size", "hidden"}


def parse(
    argv: list[str] | None, names: Iterable[str], prog: str, description: str, required: Iterable[str] = ()
) -> argparse.Namespace:
    """Parse the flags of `names`; each defaults to its environment variable, then its default."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="Every flag can also be set by the environment variable named in its help.",
    )
    names = list(names)
    for name in names:
        option = OPTIONS[name]
        default = option.default
        if option.env in os.environ:
            try:
                default = option.type(os.environ[option.env])
            except ValueError:
                parser.error(f"${option.env}={os.environ[option.env]!r} is not a valid {option.type.__name__}")
        parser.add_argument(
            option.flag,
            type=option.type,
            default=default,
            help=f"{option.help} (${option.env}; default: %(default)s)",
        )
    args = parser.parse_args(argv)
    for name in names:
        value = getattr(args, name)
        if name in _POSITIVE and value <= 0:
            parser.error(f"{OPTIONS[name].flag} must be positive, got {value}")
    for name in required:
        if getattr(args, name) in (None, ""):
            parser.error(f"{OPTIONS[name].flag} (or ${OPTIONS[name].env}) is required")
    if "collector_id" in names and not args.collector_id:
        args.collector_id = _default_collector_id()
    return args


def to_env(args: argparse.Namespace, names: Iterable[str]) -> dict[str, str]:
    """The environment variables that give a child process these settings."""
    env = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            env[OPTIONS[name].env] = str(value)
    return env


def describe(values: Mapping[str, Any]) -> str:
    """`name=value` pairs for a start-up line."""
    return " ".join(f"{k}={v}" for k, v in values.items())
