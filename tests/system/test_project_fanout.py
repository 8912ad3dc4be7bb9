"""The arithmetic of bench/project_fanout.py (the 1,000-collector projection): the tree it
builds, the transfer times, the freshness sum and the egress, and where its figures come from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.project_fanout import Measured, MiB, main, measured_from_results, project, relay_levels, transfer_ms

MEASURED = Measured(fixed_ms=100.0, hop_ms=20.0, source="test")


@pytest.mark.parametrize(
    ("collectors", "fanout", "levels"),
    [
        (1, 8, []),
        (8, 8, []),  # the primary feeds them all
        (9, 8, [2]),
        (32, 8, [4]),  # the bench row's shape
        (64, 8, [8]),
        (65, 8, [2, 9]),
        (1000, 8, [2, 16, 125]),
        (1000, 10, [10, 100]),
        (1000, 32, [32]),
    ],
)
def test_relay_levels(collectors: int, fanout: int, levels: list[int]) -> None:
    assert relay_levels(collectors, fanout) == levels


def test_every_node_feeds_at_most_fanout() -> None:
    for collectors in (1, 7, 100, 999, 1000, 4097, 100_000):
        for fanout in (2, 3, 8, 16):
            levels = relay_levels(collectors, fanout)
            if not levels:
                assert collectors <= fanout
                continue
            assert levels[0] <= fanout  # the primary's children
            below = [*levels[1:], collectors]
            assert all(math.ceil(b / n) <= fanout for n, b in zip(levels, below, strict=True))


@pytest.mark.parametrize(("collectors", "fanout"), [(0, 8), (10, 1)])
def test_relay_levels_refuses_impossible_trees(collectors: int, fanout: int) -> None:
    with pytest.raises(ValueError, match="fan-out"):
        relay_levels(collectors, fanout)


def test_transfer_ms() -> None:
    assert transfer_ms(1_250_000_000, 10) == pytest.approx(1000.0)  # 10 Gb in 1 s
    assert transfer_ms(100 * MiB, 10) == pytest.approx(100 * MiB * 8 / 1e10 * 1e3)


def test_projection_sums_its_parts() -> None:
    model = 1_250_000_000  # one second over a 10 Gb/s link
    p = project(1000, 8, 10.0, model, MEASURED, chunk_bytes=1_250_000, verify_gbps=12.5)
    assert p.relay_levels == [2, 16, 125]
    assert p.link_transfer_ms == pytest.approx(1000.0)
    assert p.transfer_ms == pytest.approx(8000.0)  # a relay sends 8 copies
    assert p.per_level_ms == pytest.approx(20.0 + 1.0 + 100.0)  # hop + one chunk + verify
    assert p.freshness_ms == pytest.approx(100.0 + 8000.0 + 3 * 121.0)
    assert p.direct_freshness_ms == pytest.approx(100.0 + 1000 * 1000.0)
    assert p.primary_children == 2
    assert p.origin_egress_bytes == 2 * model
    assert p.direct_origin_egress_bytes == 1000 * model
    assert p.relay_egress_bytes == 8 * model
    assert p.max_publishes_per_second == pytest.approx(1 / 8)  # a relay's link carries 8 copies per version


def test_origin_egress_does_not_grow_with_collectors() -> None:
    model = 16 * MiB
    for collectors in (9, 100, 1000, 10_000, 1_000_000):
        p = project(collectors, 8, 10.0, model, MEASURED)
        assert p.origin_egress_bytes <= 8 * model


def test_no_relays_when_the_primary_feeds_everyone() -> None:
    p = project(4, 8, 10.0, 16 * MiB, MEASURED)
    assert p.relay_levels == []
    assert p.freshness_ms == pytest.approx(p.direct_freshness_ms)


def test_figures_from_a_results_file(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    extra = {"single_median_ms": 40.0, "p50_ms": 55.5, "file_bytes": 16 * MiB + 400}
    rows = [{"name": "fanout_tree_single", "status": "ok"}, {"name": "fanout_tree", "status": "ok", "extra": extra}]
    results.write_text(json.dumps({"meta": {}, "rows": rows}))
    measured = measured_from_results(results)
    assert (measured.fixed_ms, measured.hop_ms) == (40.0, 15.5)


def test_a_tree_faster_than_one_collector_adds_nothing_per_hop(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    extra = {"single_median_ms": 40.0, "p50_ms": 35.0, "file_bytes": 16 * MiB}
    results.write_text(json.dumps({"rows": [{"name": "fanout_tree", "status": "ok", "extra": extra}]}))
    assert measured_from_results(results).hop_ms == 0.0


def test_results_without_the_row(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [{"name": "fanout_tree", "status": "error", "extra": {}}]}))
    with pytest.raises(ValueError, match="no measured fanout_tree row"):
        measured_from_results(results)


def test_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["--collectors", "1000", "--fanout", "8", "--link-gbps", "10", "--model-mib", "100"]
    assert main([*argv, "--fixed-ms", "100", "--hop-ms", "20"]) == 0
    out = capsys.readouterr().out
    assert "relays per level (primary's children first): 2 -> 16 -> 125 (143 relays, 3 levels)" in out
    assert "origin egress per version: 200 MiB = 2x the model (without relays: 100,000 MiB)" in out
    assert "the busiest link is full at 1.49 publishes/s" in out  # 10 Gb/s / (8 x 100 MiB)
    assert "more than the busiest node's link carries" in out  # the default 2 publishes/s
    assert main([*argv, "--results", str(tmp_path / "missing.json")]) == 2
    assert "give both --fixed-ms and --hop-ms" in capsys.readouterr().err
