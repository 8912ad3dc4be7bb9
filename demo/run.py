"""The actor-learner demo on one machine: a weight server, a trainer and collectors.

Starts `python -m weightserver serve` on a free loopback port, then `python -m demo.trainer`
and `--collectors` x `python -m demo.collector`, configured through the same environment
variables `docker/compose.yaml` sets. The trainer trains DDPG on PendulumEnv for `--seconds`,
publishing its actor every `--publish-every` steps; the collectors pull each new version
before every batch and send their experience back through a spool directory. At the end the
trainer prints the summary; this process stops the server, checks every exit code, writes
`--summary-json` and draws the run (`--plot`, demo.plot). Ctrl-C stops everything cleanly.

    python -m demo --seconds 150
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from demo import config
from demo.jsonfile import write_json_atomic
from demo.output import say
from demo.processes import Child, child_env, python_module, start_server

SHARED = [n for n in config.TRAINER_OPTIONS + config.COLLECTOR_OPTIONS if n not in ("collector_id", "summary_json")]


def start_children(args: Any, address: str, spool_dir: Path, summary_path: Path) -> list[Child]:
    settings = config.to_env(args, dict.fromkeys(SHARED))
    settings.update({"WEIGHTSERVER_ADDRESS": address, "DEMO_SPOOL_DIR": str(spool_dir)})
    trainer_env = child_env({**settings, "DEMO_SUMMARY_JSON": str(summary_path)})
    children = [Child("trainer", python_module("demo.trainer"), trainer_env).start()]
    for i in range(args.collectors):
        name = f"collector-{i}"
        env = child_env({**settings, "DEMO_COLLECTOR_ID": name})
        children.append(Child(name, python_module("demo.collector"), env).start())
    return children


def supervise(children: list[Child], limit: float) -> str:
    """Wait for every child to exit; stop them all if one fails, on Ctrl-C or after `limit` s."""
    deadline = time.monotonic() + limit
    try:
        while any(c.poll() is None for c in children):
            failed = [c for c in children if c.poll() not in (None, 0)]
            if failed:
                say("demo", f"{failed[0].name} exited with {failed[0].poll()}: stopping the others")
                return "failure"
            if time.monotonic() > deadline:
                say("demo", f"still running after {limit:.0f}s: stopping everything")
                return "timeout"
            time.sleep(0.2)
    except KeyboardInterrupt:
        say("demo", "Ctrl-C: stopping the trainer and collectors (they report first)")
        return "interrupted"
    return "done"


def stop_all(children: list[Child], timeout: float) -> None:
    """SIGTERM every child still running (a clean stop), then wait; kill the stragglers."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            child.wait(max(0.1, deadline - time.monotonic()))
    except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
        for child in children:
            child.signal(signal.SIGKILL)
            child.wait(5)


def plot_path(args: Any) -> Path | None:
    """`--plot`: a file; "auto": beside `--summary-json` (its name, .png), else demo.png here;
    "none": no plot."""
    if args.plot == "none":
        return None
    if args.plot != "auto":
        return Path(args.plot)
    return Path(args.summary_json).with_suffix(".png") if args.summary_json else Path("demo.png")


def plot(summary: dict[str, Any], path: Path) -> None:
    """Draw the run into `path`; without matplotlib (or a summary) one line says why not."""
    if "timeline" not in summary:
        say("demo", "plot skipped: the trainer wrote no summary")
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        say("demo", "plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    from demo.plot import write_plot

    write_plot(summary, path)
    say("demo", f"plot: episode reward, collector lag and freshness over time in {path}")


def main(argv: list[str] | None = None) -> int:
    args = config.parse(argv, config.RUN_OPTIONS, "python -m demo", __doc__.splitlines()[0])
    # Ctrl-C (SIGINT) stops the demo cleanly even when it was started with SIGINT ignored, as a
    # shell without job control starts every background command (`python -m demo &` in a
    # script): Python then installs no handler of its own, and `kill -INT` would do nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="weightserver-demo-"))
    spool_dir = Path(args.spool_dir) if args.spool_dir else workdir / "spool"
    summary_path = workdir / "summary.json"
    say(
        "demo",
        f"DDPG on PendulumEnv: 1 trainer, {args.collectors} collectors, {args.seconds:.0f}s of training; "
        f"publish every {args.publish_every} steps, {args.frames_per_batch} frames per batch; workdir {workdir}",
    )
    with open(workdir / "server.log", "ab") as server_log:
        server, address = start_server(workdir, args.port, args.data_dir, server_log)
        say("demo", f"weightserver serving on {address} (pid {server.pid}, log {server_log.name})")
        children: list[Child] = []
        outcome = "failure"
        try:
            children = start_children(args, address, spool_dir, summary_path)
            outcome = supervise(children, args.seconds + 2 * args.drain_timeout + 120)  # first batch, training, reports
        finally:
            stop_all(children, args.drain_timeout + 15)
            server_code = server.stop(15)
    codes = {"weightserver": server_code, **{c.name: c.poll() for c in children}}
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update({"exit_codes": codes, "outcome": outcome, "wall_seconds": round(time.monotonic() - started, 1)})
    if args.summary_json:
        write_json_atomic(Path(args.summary_json), summary)
    to = plot_path(args)
    if to is not None:
        plot(summary, to)
    clean = all(code == 0 for code in codes.values())
    listed = ", ".join(f"{name} {code}" for name, code in codes.items())
    say("demo", f"exit codes: {listed}; wall time {summary['wall_seconds']:.0f}s")
    if clean:
        shutil.rmtree(workdir, ignore_errors=True)  # kept after a failure: the server log is there
    if outcome == "interrupted":
        return 130
    ok = clean and outcome == "done" and summary.get("spool_empty", False)
    say("demo", "OK: actor-learner loop complete" if ok else f"FAILED (see above; server log in {workdir})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
