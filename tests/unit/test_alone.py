"""tests/alone.py: on 2 workers, an alone test runs while no other test runs, and the
others still run two at a time. Checked on a small suite of sleeping tests run by pytest-xdist."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

SUITE = textwrap.dedent(
    """
    import os, time, pytest

    def run(name):
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
        time.sleep(0.4)
        with open(os.environ["HOST_LOCK_LOG"], "a") as log:
            log.write(f"{name} {start} {time.monotonic()}\\n")

    # First, so that it starts beside the other worker's first test unless the lock keeps it alone.
    @pytest.mark.alone
    def test_alone():
        run("alone")

    @pytest.mark.parametrize("i", range(5))
    def test_plain(i):
        run(f"plain{i}")
    """
)


def run_suite(folder: Path, marked: bool) -> dict[str, tuple[float, float]]:
    """Runs SUITE on 2 workers (with alone marking its first test or not): name -> (start, end)."""
    (folder / "test_suite.py").write_text(SUITE if marked else SUITE.replace("@pytest.mark.alone", ""))
    log = folder / "log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "HOST_LOCK_LOG": str(log),
        "WEIGHTSERVER_TEST_LOCK_DIR": str(folder),  # not the host's: this test holds that one
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # only the plugins named below: quicker to start
    }
    plugins = ["-p", "xdist", "-p", "alone", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", "-q", *plugins, "-n", "2", "test_suite.py"]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    spans = {}
    for line in log.read_text().splitlines():
        name, start, end = line.split()
        spans[name] = (float(start), float(end))
    log.unlink()
    assert len(spans) == 6
    return spans


def overlapping(spans: dict[str, tuple[float, float]], name: str) -> list[str]:
    start, end = spans[name]
    return [other for other, (s, e) in spans.items() if other != name and s < end and start < e]


@pytest.mark.parametrize("marked", [True, False], ids=["alone", "unmarked"])
def test_an_alone_test_runs_alone_while_the_others_run_two_at_a_time(tmp_path: Path, marked: bool):
    spans = run_suite(tmp_path, marked)
    plain = [name for name in spans if name.startswith("plain")]
    assert any(overlapping({n: spans[n] for n in plain}, n) for n in plain), spans  # 2 workers at once
    if marked:
        assert overlapping(spans, "alone") == [], spans
    else:  # the same suite unmarked: its first test ran beside another, as the lock would not allow
        assert overlapping(spans, "alone"), spans
