"""The actor-learner demo end to end: `python -m demo` with tiny settings, real processes (a
weight server, a DDPG trainer, two torchrl collectors, a spool directory), no mocks."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from images import png_problems

pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")

REPO = Path(__file__).resolve().parents[2]
TINY = [
    *("--frames-per-batch", "50", "--warmup-frames", "200", "--random-frames", "100"),
    *("--publish-every", "25", "--batch-size", "64", "--progress-seconds", "2"),
]


def demo_command(tmp_path: Path, seconds: float) -> list[str]:
    return [
        *(sys.executable, "-m", "demo", "--seconds", str(seconds), *TINY),
        *("--spool-dir", str(tmp_path / "spool"), "--summary-json", str(tmp_path / "summary.json")),
    ]


def processes_using(spool: Path) -> list[int]:
    """Live processes whose environment names this spool (the demo's children do)."""
    needle = f"DEMO_SPOOL_DIR={spool}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone, or not ours to read
    return found


def still_running(pids: list[int], grace: float = 5.0) -> list[int]:
    """Those of `pids` still alive after `grace` seconds (helpers such as multiprocessing's
    resource tracker exit a moment after their parent)."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.slow
def test_demo_trains_publishes_and_collectors_follow(tmp_path: Path):
    result = subprocess.run(demo_command(tmp_path, 8), cwd=REPO, capture_output=True, text=True, timeout=100)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(json.dumps(summary, indent=1))  # shown when an assertion fails

    assert summary["exit_codes"] == {"weightserver": 0, "trainer": 0, "collector-0": 0, "collector-1": 0}
    assert summary["versions_published"] >= 5
    assert summary["final_version"] - summary["first_version"] + 1 == summary["versions_published"]
    assert sorted(summary["collectors"]) == ["collector-0", "collector-1"]
    for report in summary["collectors"].values():
        assert report["versions_applied"] >= 2, report
        assert report["final_version"] == summary["final_version"], report  # ends on the trainer's latest
        assert report["frames"] > 0 and report["fetched_bytes"] > 0, report
    # lag: the server's latest version minus the collector's, after each batch (a batch takes a
    # few hundredths of a second; the trainer publishes several versions per second)
    assert summary["lag"]["max"] is not None and summary["lag"]["max"] <= 5, summary["lag"]
    assert summary["lag"]["mean"] <= 2, summary["lag"]
    assert summary["bytes_served"] == sum(r["fetched_bytes"] for r in summary["collectors"].values())
    # freshness: the trainer's publish call -> a collector applied that version (both monotonic)
    fresh = summary["freshness"]
    assert fresh["samples"] > 0 and 0 <= fresh["p50_ms"] <= fresh["max_ms"], fresh
    assert sorted(fresh["per_collector"]) == ["collector-0", "collector-1"]
    assert fresh["samples"] == sum(c["samples"] for c in fresh["per_collector"].values())
    # every collected frame went through the spool and was consumed; nothing is left there
    assert summary["frames_consumed"] == summary["frames_collected"] > 0
    assert summary["updates"] > 0 and summary["reward"]["episodes"] > 0
    assert summary["spool_empty"] and summary["spool_leftovers"] == []
    session = tmp_path / "spool" / json.loads((tmp_path / "spool" / "session.json").read_text())["id"]
    assert not any((session / "ready").iterdir()) and not any((session / "incoming").iterdir())
    # live progress lines from every process, then the summary
    needles = ("trainer ", "published v", "collector-0 ", "collector-1 ", "applied v", "summary ", "OK:")
    for needle in (*needles, "freshness (publish call -> collector applied, pulled before each batch): p50 "):
        assert needle in output, needle
    assert still_running(processes_using(tmp_path / "spool")) == []
    # the timeline (seconds since the trainer started) and its plot beside the summary (--plot auto)
    timeline = summary["timeline"]
    assert len(timeline["reward"]) == summary["reward"]["episodes"]
    assert sorted(timeline["lag"]) == sorted(timeline["freshness"]) == ["collector-0", "collector-1"]
    for name, report in summary["collectors"].items():
        assert len(timeline["lag"][name]) == len(report["lag_at"]) > 0
        assert [ms for _, ms in timeline["freshness"][name]] and all(s >= 0 for s, _ in timeline["freshness"][name])
    assert sum(len(points) for points in timeline["freshness"].values()) == fresh["samples"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert f"plot: episode reward, collector lag and freshness over time in {tmp_path / 'summary.png'}" in output
        assert png_problems(tmp_path / "summary.png", width=1000, min_height=800) == []
    else:
        assert "plot skipped: matplotlib is not installed (pip install matplotlib)" in output


@pytest.mark.slow
def test_ctrl_c_stops_every_process_cleanly(tmp_path: Path):
    demo = subprocess.Popen(
        demo_command(tmp_path, 300), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert demo.stdout is not None
        lines = []
        for line in demo.stdout:  # wait until both collectors have applied a version
            lines.append(line)
            if sum("applied v" in seen for seen in lines) >= 2:
                break
        children = processes_using(tmp_path / "spool")  # and any helpers they started
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
        assert sorted(c[2].decode() for c in commands if c[1:2] == [b"-m"]) == [
            "demo.collector",
            "demo.collector",
            "demo.trainer",
        ]
        started = time.monotonic()
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        try:
            rest, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired as stuck:
            pytest.fail(f"the demo still runs 60 s after SIGINT; its output:\n{''.join(lines)}{stuck.output or ''}")
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.communicate()  # reaped and its pipe closed, whatever happened
    output = "".join(lines) + rest
    assert demo.returncode == 130, output[-4000:]
    assert time.monotonic() - started < 30
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    assert set(summary["exit_codes"].values()) == {0}, summary["exit_codes"]  # each stopped cleanly
    assert summary["spool_empty"] and len(summary["collectors"]) == 2
    server_pid = int(re.search(r"weightserver serving on \S+ \(pid (\d+)", output).group(1))
    assert still_running([*children, server_pid]) == []


def test_freshness_counts_each_collectors_updates_after_its_first():
    from demo.summary import freshness

    published_at = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}
    reports = {
        "a": {"applied_at": [[1, 10.5], [2, 11.010], [4, 13.020]]},  # v1: start-up catch-up, not counted
        "b": {"applied_at": [[2, 11.3], [3, 12.004]]},
        "c": {"applied_at": [[4, 13.5]]},  # only its first: nothing to count
    }
    fresh = freshness(published_at, reports)
    assert fresh["samples"] == 3 and fresh["p50_ms"] == 10.0 and fresh["max_ms"] == 20.0
    assert fresh["per_collector"]["a"] == {"p50_ms": 15.0, "max_ms": 20.0, "samples": 2}
    assert fresh["per_collector"]["c"] == {"p50_ms": None, "max_ms": None, "samples": 0}
    assert freshness({}, {})["p50_ms"] is None
