"""A short soak (bench/soak.py) against a real server process: watchers, fetchers and a fast
publisher for a few seconds, with no errors and no watch event missed.

The full soak (10 minutes, 64 watchers) is `.venv/bin/python bench/soak.py`; CI runs
`bench/soak.py --seconds 30` separately.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import soak  # noqa: E402

SECONDS = 8.0
PUBLISH_INTERVAL = 0.25


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_short_soak_has_no_errors_and_no_missed_versions(tmp_path: Path) -> None:
    """Run through the command line CI runs (`bench/soak.py --seconds 30`), so that its options
    are checked by their effect on a real soak: 16 watchers, 2 fetchers, auto then stream."""
    report = tmp_path / "soak.json"
    argv = ["--seconds", str(SECONDS), "--watchers", "16", "--fetchers", "2", "--model-bytes", "1MiB"]
    argv += ["--publish-interval", str(PUBLISH_INTERVAL), "--watch-channels", "4", "--transports", "auto,stream"]
    code = soak.main([*argv, "--json", str(report)])
    result = json.loads(report.read_text())
    summary = json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1)[:4000]

    assert not result["interrupted"], summary
    assert result["error_count"] == 0, summary
    assert result["server_exit_code"] == 0, summary
    # The exit code says whether the soak passed; only the RSS trend may fail it (8 s is too
    # short to call one), so it is judged but not asserted here.
    assert code == (0 if result["ok"] else 1) and result["ok"] == result["rss"]["flat"], summary
    # Every watcher saw every acknowledged version exactly once, in order, with no gap.
    assert result["watchers_missing"] == 0, summary
    assert len(result["watchers"]) == 16
    for watcher in result["watchers"]:
        assert watcher["versions"] == result["acked_versions"], summary
        assert watcher["gaps"] == 0
    # The publisher kept (roughly) its schedule: 32 publishes plus the first, half is plenty.
    assert result["published"] >= SECONDS / PUBLISH_INTERVAL / 2, summary
    assert result["acked_versions"] == list(range(1, result["published"] + 1)), summary
    assert [f["transport"] for f in result["fetchers"]] == ["auto", "stream"], summary
    assert result["fetches"] >= 20 and result["fetch_errors"] == 0, summary
    assert len(result["samples"]) >= 5 and result["rss"]["start"] > 0, summary


def test_missed_versions_are_named_in_ranges() -> None:
    """How a watcher's missed versions are reported: first to last of each run."""
    assert soak._ranges([1, 2, 3, 7, 9, 10]) == "v1-v3, v7, v9-v10"
    assert soak._ranges(list(range(0, 40, 2))) == ", ".join(f"v{v}" for v in range(0, 20, 2)) + " (+10 more)"
