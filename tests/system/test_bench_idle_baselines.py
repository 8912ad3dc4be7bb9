"""bench's baselines for rows that idle before each publish, measured for real: torchrl's own
MultiSyncCollector weight sync (`torchrl_shared_mem`) and a memcpy, each after the same idle as the
rows' publishes, with torchrl's updates back to back kept beside."""

from __future__ import annotations

import pytest

from bench import baselines


def test_each_update_follows_the_freshness_rows_idle_and_the_back_to_back_series_is_kept(monkeypatch):
    pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")
    monkeypatch.setattr(baselines, "IDLE_GAP_SECONDS", 0.25)
    (row,) = baselines.torchrl_shared_mem([1 << 16], repeats=3)

    assert row.name == "torchrl_shared_mem" and row.size == 1 << 16
    assert row.extra["idle_seconds"] == 0.25
    assert len(row.extra["seconds"]) == len(row.extra["hot_seconds"]) == 3
    assert row.extra["seconds"] != row.extra["hot_seconds"]  # two series, not one reported twice
    assert row.extra["verified_shared_buffer"], "the workers' shared buffer does not hold the last update"
    assert "each after 0.25 s idle" in row.note and "back to back" in row.note
    # the judged samples are the after-idle series (GB/s of the bytes actually moved)
    assert row.samples == pytest.approx([row.extra["param_bytes"] / s / 1e9 for s in row.extra["seconds"]])


def test_memcpy_after_idle_copies_one_cold_pair_per_sample(monkeypatch):
    monkeypatch.setattr(baselines, "IDLE_GAP_SECONDS", 0.05)
    row = baselines.memcpy_after_idle(1 << 20, repeats=3)

    assert row.name == "memcpy_after_idle" and row.size == 1 << 20
    assert row.extra["pairs_per_sample"] == 1  # back to back, 256 pairs of 1 MiB per sample
    assert len(row.extra["seconds"]) == 3 and row.note.endswith("each after 0.05 s idle")
    assert baselines.memcpy(1 << 20, repeats=1).extra["pairs_per_sample"] == 256
