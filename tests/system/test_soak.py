"""A short soak (bench/soak.py) against a real server process: watchers, fetchers and a fast
publisher for a few seconds, with no errors and no watch event missed.

The full soak (10 minutes, 64 watchers) is `.venv/bin/python bench/soak.py`; CI runs
`bench/soak.py --seconds 30` separately.
"""

from __future__ import annotations

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
def test_short_soak_has_no_errors_and_no_missed_versions() -> None:
    lines: list[str] = []
    config = soak.SoakConfig(
        seconds=SECONDS,
        watchers=16,
        fetchers=2,
        publish_interval=PUBLISH_INTERVAL,
        model_bytes=1 << 20,
        watch_channels=4,
        transports=("auto", "stream"),
    )
    result = soak.run_soak(config, on_progress=lines.append)
    summary = soak.format_summary(result)

    assert not result.interrupted, summary
    assert result.error_count == 0, summary
    assert result.server_exit_code == 0, summary
    # Every watcher saw every acknowledged version exactly once, in order, with no gap.
    assert result.watchers_missing == 0, summary
    assert len(result.watchers) == 16
    for watcher in result.watchers:
        assert watcher["versions"] == result.acked_versions, summary
        assert watcher["gaps"] == 0
    # The publisher kept (roughly) its schedule: 32 publishes plus the first, half is plenty.
    assert result.published >= SECONDS / PUBLISH_INTERVAL / 2, summary
    assert result.acked_versions == list(range(1, result.published + 1)), summary
    assert result.fetches >= 20 and result.fetch_errors == 0, summary
    # RSS is sampled and judged (not asserted here: 8 s is too short to call it a trend).
    assert len(result.samples) >= 5 and result.rss["start"] > 0, summary


def test_ranges_and_arguments() -> None:
    assert soak._ranges([1, 2, 3, 7, 9, 10]) == "v1-v3, v7, v9-v10"
    args = soak.parse_args(["--seconds", "30", "--model-bytes", "1MiB", "--transports", "auto,bulk"])
    config = soak.config_from_args(args)
    assert config.seconds == 30 and config.model_bytes == 1 << 20 and config.transports == ("auto", "bulk")
    assert config.watchers == 64 and config.fetchers == 8 and config.publish_interval == 1.0
