"""bench/shm_copy.py, the profile of what owning a shared-memory publish's bytes costs: every
way is timed, the server's own code included."""

from __future__ import annotations

import pytest

from bench import shm_copy


def test_every_way_is_timed(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    shm_copy.main(["--size", "4MiB", "--count", "1", "--dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4MiB, 1 trials each")
    assert [line.split()[0] for line in lines[1:]] == ["map", "pread", "server"]
    assert all(float(line.split()[line.split().index("done") + 1]) > 0 for line in lines[1:])
