"""The demo's plot (demo/plot.py) and what feeds it (demo.summary.timeline), without running the
demo; tests/system/test_demo.py checks the plot of a real run."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
from images import png_problems

from demo.plot import rolling_mean
from demo.run import plot, plot_path
from demo.summary import freshness, timeline

REPO = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 1000, 800  # demo.plot.SIZE at its DPI


def summary_of(episodes: int = 40, batches: int = 60) -> dict:
    started = 1000.0
    published_at = {v: started + 0.5 * v for v in range(1, 41)}
    reports = {
        name: {
            "applied_at": [[v, published_at[v] + 0.02 + 0.01 * i] for v in range(1, 41, 2)],
            "lag_at": [[started + 0.3 * b, int((b + i) % 3 == 0)] for b in range(batches)],
        }
        for i, name in enumerate(["collector-0", "collector-1"])
    }
    rewards = [(started + 0.5 * e, -1500.0 + 35 * e) for e in range(episodes)]
    return {
        "train_seconds": 20.0,
        "versions_published": 40,
        "collectors": reports,
        "freshness": freshness(published_at, reports),
        "timeline": timeline(started, rewards, published_at, reports),
    }


def test_the_timeline_is_in_seconds_since_the_trainer_started():
    line = timeline(
        100.0,
        [(101.5, -1200.04)],
        {1: 100.0, 2: 102.0},
        {"c": {"applied_at": [[1, 100.5], [2, 102.0312]], "lag_at": [[100.25, 0], [102.5, 1]]}},
    )
    assert line == {
        "reward": [[1.5, -1200.0]],
        "lag": {"c": [[0.25, 0], [2.5, 1]]},
        "freshness": {"c": [[2.03, 31.2]]},  # v1 is the collector's start-up catch-up: not a refresh
    }


def test_rolling_mean_averages_up_to_the_window():
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([], 10) == []


def test_the_plot_of_a_run_and_of_an_empty_one(tmp_path: Path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -e '.[dev]'")
    plot(summary_of(), tmp_path / "run.png")
    assert "plot: episode reward, collector lag and freshness over time in" in capsys.readouterr().out
    assert png_problems(tmp_path / "run.png", width=WIDTH, min_height=HEIGHT) == []
    empty = summary_of(episodes=0, batches=0)
    empty["timeline"]["freshness"] = {}
    plot(empty, tmp_path / "empty.png")  # every panel says what it lacks
    assert png_problems(tmp_path / "empty.png", width=WIDTH, min_height=HEIGHT) == []


def test_without_matplotlib_or_a_summary_one_line_says_why_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    plot(summary_of(), tmp_path / "run.png")
    assert capsys.readouterr().out.split(maxsplit=1)[1] == (
        "plot skipped: matplotlib is not installed (pip install matplotlib)\n"
    )
    plot({"exit_codes": {"trainer": 1}}, tmp_path / "run.png")
    assert "plot skipped: the trainer wrote no summary" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_the_plot_goes_beside_the_summary_unless_told_otherwise():
    assert plot_path(Namespace(plot="auto", summary_json="out/run.json")) == Path("out/run.png")
    assert plot_path(Namespace(plot="auto", summary_json=None)) == Path("demo.png")
    assert plot_path(Namespace(plot="x/p.png", summary_json="out/run.json")) == Path("x/p.png")
    assert plot_path(Namespace(plot="none", summary_json="out/run.json")) is None


def test_the_committed_demo_plot_is_drawn():
    """docs/img/demo.png: a real run (bench/README.md names the command)."""
    assert png_problems(REPO / "docs" / "img" / "demo.png", width=WIDTH, min_height=HEIGHT) == []
