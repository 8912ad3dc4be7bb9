"""bench/plots.py: the charts of a results file, from a small synthetic one and from the results
the committed charts in docs/img were drawn from; and the checks the chart tests rely on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -e '.[dev]'")

from images import pixels_near, png_problems

from bench import plots

REPO = Path(__file__).resolve().parents[2]
COMMITTED = [REPO / "docs" / "img" / "bench-results.json"]
MiB = 1 << 20
RED = plots.COLOURS["FAIL"]


def row(name: str, size: int | None, unit: str, samples: list[float], **fields: Any) -> dict[str, Any]:
    """A row as `Row.as_dict()` writes it."""
    ordered = sorted(samples)
    return {
        "name": name,
        "kind": "row",
        "size_bytes": size,
        "unit": unit,
        "status": "ok",
        "samples": samples,
        "median": ordered[len(ordered) // 2] if samples else None,
        "min": min(samples, default=None),
        "max": max(samples, default=None),
        "baseline": None,
        "baseline_median": None,
        "ratio": None,
        "target": "",
        "passed": None,
        "note": "",
        "extra": {},
        **fields,
    }


def judged(name: str, size: int, unit: str, samples: list[float], baseline: float, op: str, limit: float) -> dict:
    value = sorted(samples)[len(samples) // 2]
    ratio = value / baseline
    return row(
        name,
        size,
        unit,
        samples,
        baseline=f"base_of_{name}",
        baseline_median=baseline,
        ratio=ratio,
        target=f"ratio {op} {limit:g}x",
        passed=ratio <= limit if op == "<=" else ratio >= limit,
    )


def trace_row(name: str, full: int, deltas: list[int]) -> dict[str, Any]:
    versions = [
        {
            "version": i + 2,
            "delta_wire_bytes": d,
            "tensor_delta_wire_bytes": full,
            "sparse_only_bytes": d,
            "bitmap_only_bytes": 2 * d,
            "xor_zlib": {"bytes": d},
        }
        for i, d in enumerate(deltas)
    ]
    extra = {"full_wire_bytes": full, "what": "a synthetic trace", "versions": versions}
    return row(name, None, "x", [full / d for d in deltas], target="ratio >= 20x", passed=True, extra=extra)


def synthetic(fail: bool = True) -> dict[str, Any]:
    slow = 40.0 if fail else 20.0
    return {
        "meta": {"git_head": "0123456789abcdef", "git_dirty": False, "finished": "2026-11-27T08:00:00+00:00"},
        "rows": [
            {**row("raw_tcp", 16 * MiB, "GB/s", [4.0, 4.2]), "kind": "baseline"},
            judged("freshness_remote", 16 * MiB, "ms", [slow, slow + 1, slow + 3], 27.0, "<=", 1.3),
            judged("freshness_remote", 256 * MiB, "ms", [300.0, 310.0, 330.0], 250.0, "<=", 1.3),
            row("freshness_remote_no_cut_through", 16 * MiB, "ms", [30.0, 35.0], baseline="x", baseline_median=33.0),
            row("freshness_link_1gbit", 16 * MiB, "ms", [], status="n/a", note="needs root"),
            row("freshness_8", 16 * MiB, "-", [], status="error", note="TimeoutError: collectors never applied"),
            judged("fetch_live_policy", 256 * MiB, "GB/s", [2.4, 2.6, 2.7], 2.0, ">=", 0.7),
            judged("publish_bulk", 16 * MiB, "ms", [12.0, 15.0, 19.0], 4.0, "<=", 1.3 if fail else 4.0),
            row("fanout_8", 16 * MiB, "-", [], status="error", note="RuntimeError: a worker died"),
            row("watch_latency", None, "ms", [-0.4, 0.2]),  # neither chart's
            trace_row("trace_lm_delta", 268_000_000, [18_000_000, 12_000_000, 9_000_000]),
            row("trace_ddpg_delta", None, "-", [], status="error", note="InternalServerError: TypeError"),
        ],
    }


def by_name(charts: list[plots.Chart]) -> dict[str, plots.Chart]:
    return {chart.path.name: chart for chart in charts}


def test_charts_of_a_synthetic_run_draw_every_usable_row_and_list_the_others(tmp_path: Path):
    charts = by_name(plots.write_charts(synthetic()["rows"], tmp_path, ["synthetic.json"]))
    assert sorted(charts) == sorted([plots.FRESHNESS_CHART, plots.THROUGHPUT_CHART, plots.TRACE_CHART])
    for chart in charts.values():
        assert png_problems(chart.path, width=1100) == [], chart.path

    fresh = charts[plots.FRESHNESS_CHART]
    assert fresh.drawn == ["freshness_remote 16MiB", "freshness_remote 256MiB", "freshness_remote_no_cut_through 16MiB"]
    assert fresh.skipped == [
        "freshness_link_1gbit 16MiB (n/a: needs root)",
        "freshness_8 16MiB (error: TimeoutError: collectors never applied)",
    ]
    assert charts[plots.THROUGHPUT_CHART].drawn == ["fetch_live_policy 256MiB", "publish_bulk 16MiB"]
    assert charts[plots.THROUGHPUT_CHART].skipped == ["fanout_8 16MiB (error: RuntimeError: a worker died)"]
    trace = charts[plots.TRACE_CHART]
    assert trace.drawn == ["trace_lm_delta"]
    assert trace.skipped == ["trace_ddpg_delta (error: InternalServerError: TypeError)"]


def test_a_row_that_misses_its_target_stays_on_the_chart_in_red(tmp_path: Path):
    failing = by_name(plots.write_charts(synthetic(fail=True)["rows"], tmp_path / "fail", ["f.json"]))
    passing = by_name(plots.write_charts(synthetic(fail=False)["rows"], tmp_path / "pass", ["p.json"]))
    for name in (plots.FRESHNESS_CHART, plots.THROUGHPUT_CHART):
        assert failing[name].drawn == passing[name].drawn  # drawn either way
        assert pixels_near(failing[name].path, RED) > 2000, name  # its bar and its FAIL
        assert pixels_near(passing[name].path, RED) == 0, name
    bars, _ = plots.freshness_bars(synthetic(fail=True)["rows"])
    assert [b.verdict for b in bars] == ["FAIL", "PASS", ""]
    assert bars[0].allowed == pytest.approx(27.0 * 1.3)  # the tick: what `ratio <= 1.3x` allows


def test_publish_rows_are_drawn_as_bytes_over_time_against_their_baselines_rate():
    bars, _ = plots.throughput_bars(synthetic()["rows"])
    publish = next(b for b in bars if b.name == "publish_bulk")
    rate = 16 * MiB / 15e-3 / 1e9  # the median, 15 ms
    assert publish.converted and publish.unit == "GB/s"
    assert (publish.value, publish.low, publish.high) == pytest.approx((rate, rate * 15 / 19, rate * 15 / 12))
    assert publish.baseline_value == pytest.approx(16 * MiB / 4e-3 / 1e9)
    assert publish.allowed == pytest.approx(16 * MiB / (4e-3 * 1.3) / 1e9)  # `ratio <= 1.3x` on the time


def test_no_rows_gives_charts_that_say_so_and_a_non_results_file_a_clear_error(tmp_path: Path):
    charts = plots.write_charts([], tmp_path, ["empty.json"])
    assert [c.drawn for c in charts] == [[], [], []]
    for chart in charts:
        assert png_problems(chart.path, width=1100) == []  # the message is drawn
    with pytest.raises(ValueError, match=r"not-results.json: not a bench results file.*'rows'"):
        plots.merge([("not-results.json", {})])
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit) as exit_info:
        plots.main([str(tmp_path / "broken.json"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2


def test_a_later_file_replaces_the_rows_it_reran():
    first = synthetic()
    again = trace_row("trace_ddpg_delta", 18_000, [18_000, 15_000])
    rerun = {"meta": {"git_head": "fedcba9876543210", "git_dirty": True}, "rows": [again]}
    rows, sources = plots.merge([("full.json", first), ("rerun.json", rerun)])
    assert [r["status"] for r in rows if r["name"] == "trace_ddpg_delta"] == ["ok"]
    assert len(rows) == len(first["rows"])
    assert sources[0].startswith("full.json (0123456, 2026-11-27") and sources[1] == "rerun.json (fedcba9-dirty)"


def test_the_committed_results_draw_every_chart(tmp_path: Path):
    """docs/img's charts come from these files (bench/README.md gives the command)."""
    assert plots.main([*map(str, COMMITTED), "--out", str(tmp_path)]) == 0
    rows, _ = plots.merge([(p.name, json.loads(p.read_text())) for p in COMMITTED])
    fresh, fresh_skipped = plots.freshness_bars(rows)
    rates, rates_skipped = plots.throughput_bars(rows)
    assert len(fresh) >= 15 and len(rates) >= 10 and fresh_skipped == rates_skipped == []
    assert any(b.verdict == "FAIL" for b in fresh)  # that run missed some targets: they show
    for name in (plots.FRESHNESS_CHART, plots.THROUGHPUT_CHART, plots.TRACE_CHART):
        assert png_problems(tmp_path / name, width=1100) == [], name
        committed = REPO / "docs" / "img" / name
        assert png_problems(committed, width=1100) == [], committed


def test_the_blank_check_rejects_a_blank_or_misshapen_image(tmp_path: Path):
    from PIL import Image, ImageDraw

    blank = tmp_path / "blank.png"
    Image.new("RGB", (1100, 800), "white").save(blank)
    assert any("looks blank" in p for p in png_problems(blank, width=1100))
    speck = tmp_path / "speck.png"
    image = Image.new("RGB", (1100, 800), "white")
    ImageDraw.Draw(image).text((10, 10), "x", fill="black")
    image.save(speck)
    assert any("looks blank" in p for p in png_problems(speck, width=1100))
    assert any("px wide" in p for p in png_problems(blank, width=1000))


def test_bench_run_skips_the_charts_with_a_line_without_matplotlib(tmp_path: Path, monkeypatch, capsys):
    from bench import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    run.write_plots(tmp_path / "results.json", tmp_path)
    assert "charts skipped: matplotlib is not installed (pip install matplotlib" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
