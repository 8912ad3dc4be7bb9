"""demo/lifecycle.py: how a demo process ends, checked on a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
# A demo role whose work is done at once, with a teardown as slow as torch's can be on a busy
# machine: its __del__ runs while the interpreter shuts down.
FINISHED_ROLE = """
import sys, time
from demo import config
from demo.lifecycle import run_role

class SlowTeardown:
    def __del__(self):
        time.sleep(2)

keep = SlowTeardown()

def run(args, stop):
    print("done", flush=True)
    return 0

sys.exit(run_role(run, sys.argv[1:], config.COLLECTOR_OPTIONS, "collector", "test"))
"""


def test_sigterm_after_the_work_is_done_leaves_exit_code_0(tmp_path: Path):
    """compose stops every service when the trainer exits: a SIGTERM landing while a finished
    collector's interpreter shuts down (Python's handlers are gone by then) must not make its
    exit code 143."""
    env = {key: value for key, value in os.environ.items() if key != "DEMO_PARENT_PID"}
    with subprocess.Popen(
        [sys.executable, "-c", FINISHED_ROLE, "--spool-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None and process.stdout.readline() == "done\n"
            time.sleep(0.5)  # into the slow teardown
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()


def test_a_finished_role_leaves_its_objects_out_of_the_last_collection(tmp_path: Path):
    """The interpreter's last garbage collection walked every object torch made (1.5 s of a
    collector's exit here, 6.8 s on a busy machine): run_role freezes them once the work is done,
    before that collection runs (atexit runs just before it)."""
    role = """
import atexit, gc, sys
from demo import config
from demo.lifecycle import run_role

atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
sys.exit(run_role(lambda args, stop: 0, sys.argv[1:], config.COLLECTOR_OPTIONS, "collector", "test"))
"""
    env = {key: value for key, value in os.environ.items() if key != "DEMO_PARENT_PID"}
    done = subprocess.run(
        [sys.executable, "-c", role, "--spool-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "frozen True\n"


def test_a_collector_waiting_for_the_trainer_leaves_at_a_sigterm(tmp_path: Path, server):
    """After its report a collector waits for the trainer to consume its batches (compose stops
    every service once the trainer exits), for up to the drain timeout + 30 s. A SIGTERM in that
    wait ends it at once with exit code 0: it once slept on, and a stop killed it 15 s later."""
    from demo.spool import Spool

    session = Spool(tmp_path).open_session()
    env = {key: value for key, value in os.environ.items() if key != "DEMO_PARENT_PID"}
    command = [sys.executable, "-m", "demo.collector", "--spool-dir", str(tmp_path), "--server", server.address]
    with subprocess.Popen([*command, "--collector-id", "c0"], cwd=REPO, env=env, stdout=subprocess.PIPE) as process:
        try:
            wait_until(lambda: session.pending() > 0, timeout=60)  # it joined and collects
            session.stop(None)
            wait_until(lambda: "c0" in session.reports(), timeout=60)  # now waiting for the trainer
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert process.wait(timeout=30) == 0
            assert time.monotonic() - started < 5
        finally:
            if process.poll() is None:
                process.kill()


TINY_TRAINER = [
    *("--warmup-frames", "200", "--publish-every", "25", "--batch-size", "64", "--progress-seconds", "1"),
    *("--collectors", "1"),
]
TINY_COLLECTOR = ["--frames-per-batch", "50", "--random-frames", "100", "--progress-seconds", "1"]


def demo_role(role: str, tmp_path: Path, server, *flags: str) -> list[str]:
    common = ("--spool-dir", str(tmp_path / "spool"), "--server", server.address, "--seconds", "3")
    return [sys.executable, "-m", f"demo.{role}", *common, *flags]


@pytest.mark.slow
def test_the_trainers_seconds_count_from_its_first_batch(tmp_path: Path, server):
    """Collectors that start late (8 containers on a small machine take 30 s) do not take the
    trainer's training time: it trains `--seconds` from the first batch it takes. Its clock
    once started with it, so a trainer of 3 s whose collector came 6 s later had already
    stopped, and the collector never joined."""
    env = {key: value for key, value in os.environ.items() if key != "DEMO_PARENT_PID"}
    summary = tmp_path / "summary.json"
    trainer_command = demo_role("trainer", tmp_path, server, *TINY_TRAINER, "--drain-timeout", "60")
    collector_command = demo_role("collector", tmp_path, server, *TINY_COLLECTOR, "--collector-id", "late")
    with subprocess.Popen(
        [*trainer_command, "--summary-json", str(summary)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    ) as trainer:
        try:
            time.sleep(6)  # twice its --seconds: still waiting for a batch
            assert trainer.poll() is None
            with subprocess.Popen(collector_command, cwd=REPO, env=env, stdout=subprocess.DEVNULL) as collector:
                try:
                    assert trainer.wait(timeout=120) == 0, trainer.stdout.read()[-3000:]
                    assert collector.wait(timeout=60) == 0
                finally:
                    if collector.poll() is None:
                        collector.kill()
        finally:
            if trainer.poll() is None:
                trainer.kill()
    result = json.loads(summary.read_text())
    assert 3 <= result["train_seconds"] < 10, result["train_seconds"]
    assert result["updates"] > 0 and result["collectors"]["late"]["final_version"] == result["final_version"]


def test_a_trainer_with_no_batch_within_its_drain_timeout_gives_up(tmp_path: Path, server):
    env = {key: value for key, value in os.environ.items() if key != "DEMO_PARENT_PID"}
    command = demo_role("trainer", tmp_path, server, *TINY_TRAINER, "--drain-timeout", "2")
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:]  # no collector reported
    assert "no collector sent a batch in 2s (--drain-timeout): winding down" in result.stdout
    assert "trained 0 s: 0 optimisation steps" in result.stdout
    assert time.monotonic() - started < 60
