"""The demo's picture: episode reward, collector lag and freshness over the run, one PNG.

`python -m demo` draws it at the end (`--plot`) from the summary's `timeline`
(demo.summary.timeline), with matplotlib, which only that process needs: the trainer and
collector processes (and their containers) never import this module. A summary written
elsewhere (`--summary-json`, or the compose trainer's /spool/summary.json) is drawn with

    python -m demo.plot summary.json [summary.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DPI = 100
SIZE = (10.0, 8.0)  # inches: 1000 x 800 pixels
ROLLING = 10  # episodes in the reward's rolling mean


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and up to `window - 1` values before it."""
    means, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        means.append(total / min(i + 1, window))
    return means


def _empty(axes: Axes, message: str) -> None:
    axes.text(0.5, 0.5, message, ha="center", va="center", transform=axes.transAxes, color="#666666")


def _reward(axes: Axes, points: list[list[float]]) -> None:
    axes.set_ylabel("episode reward")
    if not points:
        _empty(axes, "no episode finished")
        return
    seconds, rewards = zip(*points, strict=True)
    axes.scatter(seconds, rewards, s=9, color="#9ab8d8", label="an episode (200 steps)")
    axes.plot(
        seconds, rolling_mean(rewards, ROLLING), color="#1f5a96", linewidth=2, label=f"mean of the last {ROLLING}"
    )
    axes.legend(loc="lower right", fontsize=8)


def _per_collector(axes: Axes, series: Mapping[str, list[list[float]]], step: bool, nothing: str) -> None:
    drawn = False
    for name, points in sorted(series.items()):
        if points:
            seconds, values = zip(*points, strict=True)
            if step:
                axes.step(seconds, values, where="post", linewidth=1, alpha=0.8, label=name)
            else:
                axes.plot(seconds, values, marker=".", markersize=4, linewidth=0.8, label=name)
            drawn = True
    if drawn:
        axes.legend(loc="upper right", fontsize=8)
    else:
        _empty(axes, nothing)


def write_plot(summary: Mapping[str, Any], path: Path) -> Path:
    """Draw the summary's timeline into a PNG at `path` (ImportError without matplotlib)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    timeline = summary.get("timeline") or {}
    figure = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    reward, lag, fresh = figure.subplots(3, 1, sharex=True, height_ratios=[3, 2, 2])
    collectors = len(summary.get("collectors") or {})
    figure.suptitle(
        f"weightserver demo: DDPG on PendulumEnv, 1 trainer, {collectors} collectors, "
        f"{summary.get('train_seconds', 0):.0f} s of training, {summary.get('versions_published', 0)} versions",
        fontsize=11,
        fontweight="bold",
    )
    _reward(reward, timeline.get("reward") or [])
    reward.set_title("episode reward (when the trainer took the batch that ended the episode)", loc="left", fontsize=9)
    _per_collector(lag, timeline.get("lag") or {}, step=True, nothing="no batch collected with a version")
    lag.set_ylabel("lag (versions)")
    behind = [versions for points in (timeline.get("lag") or {}).values() for _, versions in points]
    lag.set_ylim(-0.3, max([1, *behind]) + 0.3)  # 0 and 1 shown even when no collector lagged
    lag.yaxis.set_major_locator(MaxNLocator(integer=True))
    lag.set_title(
        "collector lag: the server's latest version - the collector's, after each batch", loc="left", fontsize=9
    )
    _per_collector(fresh, timeline.get("freshness") or {}, step=False, nothing="no update after a collector's first")
    fresh.set_ylabel("freshness (ms)")
    fresh.set_ylim(bottom=0)
    p50 = (summary.get("freshness") or {}).get("p50_ms")
    median = f" (p50 {p50:.1f} ms)" if p50 is not None else ""
    fresh.set_title(
        f"freshness: publish call -> the collector's policy holds the version{median}", loc="left", fontsize=9
    )
    fresh.set_xlabel("seconds since the trainer started")
    for axes in (reward, lag, fresh):
        axes.grid(color="#e6e6e6", linewidth=0.6)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, facecolor="white")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.plot", description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="a demo summary (--summary-json's file)")
    parser.add_argument("png", type=Path, nargs="?", help="the PNG to write (default: the summary's name, .png)")
    args = parser.parse_args(argv)
    try:
        summary = json.loads(args.summary.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read {args.summary}: {exc}")
    if not isinstance(summary, dict) or "timeline" not in summary:
        parser.error(f"{args.summary} has no timeline: not the summary of a demo run (or of one older than the plot)")
    print(write_plot(summary, args.png or args.summary.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
