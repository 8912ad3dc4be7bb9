"""bench/sharded_fetch.py end to end at a small size: 4 rank processes, each sent its selection
pickled, fetch their quarter of a model at once. The row's byte ratio is a figure that can fail:
the ranks together receive the model's bytes once (plus each rank's header and the shared norm),
not 4x. It runs the bench's own command, so the row cannot break unnoticed (it did once: a
selection with a glob stopped pickling)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_four_ranks_receive_the_model_once_between_them(tmp_path):
    results = tmp_path / "sharded.json"
    command = [sys.executable, "bench/run.py", "--only", "sharded_fetch", "--sizes", "4MiB", "--repeats", "1"]
    # A session of its own, so that on a timeout its server and rank processes go with it.
    with subprocess.Popen([*command, "--json", str(results), "--no-plots"], cwd=ROOT, start_new_session=True) as run:
        try:
            assert run.wait(timeout=240) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
    rows = {row["name"]: row for row in json.loads(results.read_text())["rows"]}
    assert all(row["status"] == "ok" for row in rows.values()), rows
    volume = rows["sharded_fetch_bytes"]
    (received,), model = volume["extra"]["received_bytes"], volume["extra"]["model_bytes"]
    assert model <= received <= 1.01 * model  # the quarters' headers and the norm each rank gets whole
    assert volume["passed"] is True
    assert rows["sharded_fetch"]["samples"][0] > 0 and rows["whole_fetch"]["samples"][0] > 0
