"""demo/lifecycle.py: how a demo process ends, checked on a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
