"""bench/bulk_landing.py, the profile the README's `publish_bulk` breakdown cites: both
landings are timed, with the client's own bulk transport against a bare endpoint."""

from __future__ import annotations

import pytest

from bench import bulk_landing


def test_both_landings_are_timed(capsys: pytest.CaptureFixture[str]) -> None:
    bulk_landing.main(["--size", "1MiB", "--count", "2", "--pause", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "bulk upload of 1MiB, 2 times each, after 0 s idle"
    assert [line.split(" p50 ")[0].strip() for line in lines[1:]] == [
        "reused anonymous buffer",
        "fresh shared-memory file",
    ]
    assert all(float(line.split()[-4]) > 0 for line in lines[1:])
