"""demo/lifecycle.py: how a demo process ends, checked on a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
