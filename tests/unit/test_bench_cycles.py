"""bench/freshness.py's `timed_publishes`: what it times and the CPU each process used per
publish cycle, with a fake group of collectors and a fake CPU clock (no processes, no sockets)."""

from __future__ import annotations

import itertools

import pytest

from bench import freshness
from bench.common import WARMUP_ROUNDS


class FakeGroup:
    """Two collectors that applied each version 5 ms and 7 ms after its publish was called."""

    count = 2

    def __init__(self) -> None:
        self.called: dict[int, float] = {}

    def applied(self, version: int) -> dict[int, tuple[float, str, list, bool, bool]]:
        at = self.called[version]
        return {0: (at + 0.005, "bulk", [], True, False), 1: (at + 0.007, "bulk", [], False, False)}


def test_cpu_per_cycle_runs_from_the_first_timed_publish_to_the_last_ones_start(monkeypatch):
    group, clock = FakeGroup(), itertools.count()
    # Each reading of a process's CPU clock is one second past the one before, the server's two:
    # a cycle is the readings between two timed publishes' starts, whatever the warm-up used.
    readings = {"server": itertools.count(step=2.0), "self": itertools.count(step=1.0)}
    monkeypatch.setattr(freshness, "cpu_seconds", lambda pid: next(readings[pid]))

    def publish(i: int) -> tuple[int, float, float, float | None]:
        called = float(next(clock))
        group.called[i + 1] = called
        return i + 1, called, called + 0.003, None

    timed = freshness.timed_publishes(group, 4, publish, {"server": "server", "bench": "self"})
    assert timed.cpu_per_cycle == {"server": 2.0, "bench": 1.0}
    assert len(timed.samples) == 4  # the WARMUP_ROUNDS before them are not timed
    assert timed.samples == pytest.approx([7.0] * 4)
    assert timed.publish_ms == pytest.approx([3.0] * 4)
    assert [pytest.approx([5.0, 7.0])] * 4 == timed.per_collector
    assert (timed.early, timed.used) == (4, {"bulk"})
    assert len(group.called) == WARMUP_ROUNDS + 4


def test_without_pids_or_with_one_timed_publish_no_cpu_is_reported(monkeypatch):
    group, clock = FakeGroup(), itertools.count()
    monkeypatch.setattr(freshness, "cpu_seconds", lambda pid: 1.0)

    def publish(i: int) -> tuple[int, float, float, float | None]:
        called = float(next(clock))
        group.called[i + 1] = called
        return i + 1, called, called, None

    assert freshness.timed_publishes(group, 3, publish).cpu_per_cycle == {}
    assert freshness.timed_publishes(group, 1, publish, {"server": 1}).cpu_per_cycle == {}
