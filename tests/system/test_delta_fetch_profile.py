"""bench/delta_fetch.py runs, and says what it timed: a delta over bulk, the whole version mapped on
the server's host with `auto`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"transport=(\w+) \(used (\w+)\) consume_base=(\w+) delta=(\w+) wire=([\d.]+) MiB: median ([\d.]+) ms"
)


@pytest.mark.parametrize(("transport", "used", "delta"), [("bulk", "bulk", "True"), ("auto", "shm", "False")])
def test_the_delta_fetch_profile_reports_what_it_timed(transport, used, delta):
    out = subprocess.run(
        [sys.executable, "-m", "bench.delta_fetch", "--transport", transport, "--size-mib", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found = LINE.search(out)
    assert found is not None, out
    assert found.group(1, 2, 4) == (transport, used, delta)
    wire, median = float(found.group(5)), float(found.group(6))
    assert (wire < 8 * 0.2) if delta == "True" else wire >= 8 * 0.99  # 2% of the elements, and their places
    assert median > 0
