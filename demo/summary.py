"""The end-of-run summary: built by the trainer from its own counts and the collectors' reports,
printed as lines and written as JSON (`--summary-json`)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def quarter_means(values: Sequence[float]) -> list[float]:
    """Means of the four consecutive quarters of `values` (fewer parts when there are fewer values)."""
    parts = min(4, len(values))
    means = []
    for i in range(parts):
        chunk = values[i * len(values) // parts : (i + 1) * len(values) // parts]
        means.append(sum(chunk) / len(chunk))
    return means


def reward_trend(episode_rewards: Sequence[float]) -> dict[str, Any]:
    quarters = quarter_means(episode_rewards)
    return {
        "episodes": len(episode_rewards),
        "quarters": [round(q, 1) for q in quarters],
        "first_quarter": round(quarters[0], 1) if quarters else None,
        "last_quarter": round(quarters[-1], 1) if quarters else None,
        "first_10": round(sum(episode_rewards[:10]) / len(episode_rewards[:10]), 1) if episode_rewards else None,
        "last_10": round(sum(episode_rewards[-10:]) / len(episode_rewards[-10:]), 1) if episode_rewards else None,
        "best_episode": round(max(episode_rewards), 1) if episode_rewards else None,
    }


def collector_totals(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    lags = [r["max_lag"] for r in reports.values() if r["max_lag"] is not None]
    weighted = [(r["mean_lag"], r["batches"]) for r in reports.values() if r["mean_lag"] is not None]
    batches = sum(n for _, n in weighted)
    return {
        "frames_collected": sum(r["frames"] for r in reports.values()),
        "bytes_served": sum(r["fetched_bytes"] for r in reports.values()),
        "lag": {
            "max": max(lags, default=None),
            "mean": round(sum(m * n for m, n in weighted) / batches, 3) if batches else None,
        },
    }


def refreshes(published_at: Mapping[int, float], report: Mapping[str, Any]) -> list[tuple[float, float]]:
    """(applied at, publish call -> applied in ms) for every version the collector applied after
    its first (its start-up catch-up), of those the trainer published (see `freshness`)."""
    applied = report.get("applied_at", [])[1:]
    return [(at, (at - published_at[int(v)]) * 1e3) for v, at in applied if int(v) in published_at]


def freshness(published_at: Mapping[int, float], reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Publish call -> collector applied, in ms: for every version a collector applied after
    its first (the first is its start-up catch-up, not a refresh), that collector's
    `applied_at` time minus the trainer's `published_at` time of the version. Both are
    `time.monotonic()` readings of processes on one host (one clock on Linux). Versions a
    collector skipped (a newer one had arrived by its next pull) count for none."""

    def stats(values: list[float]) -> dict[str, Any]:
        return {
            "p50_ms": round(statistics.median(values), 1) if values else None,
            "max_ms": round(max(values), 1) if values else None,
            "samples": len(values),
        }

    per_collector = {name: [ms for _, ms in refreshes(published_at, r)] for name, r in reports.items()}
    every = [ms for values in per_collector.values() for ms in values]
    return {**stats(every), "per_collector": {name: stats(values) for name, values in per_collector.items()}}


def timeline(
    started: float,
    episodes: Iterable[tuple[float, float]],
    published_at: Mapping[int, float],
    reports: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """What `python -m demo` plots (demo.plot), in seconds since the trainer started (`started`, a
    `time.monotonic()` reading, the clock every process stamps with): `reward`, [s, reward] of
    every episode (when the trainer took its batch); per collector `lag`, [s, versions behind the
    server's latest] after each batch, and `freshness`, [s, ms from publish call to applied] of
    each update after its first."""

    def since(at: float) -> float:
        return round(at - started, 2)

    return {
        "reward": [[since(at), round(reward, 1)] for at, reward in episodes],
        "lag": {name: [[since(at), lag] for at, lag in r.get("lag_at", [])] for name, r in reports.items()},
        "freshness": {
            name: [[since(at), round(ms, 1)] for at, ms in refreshes(published_at, r)] for name, r in reports.items()
        },
    }


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _kb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a few lines for a person."""
    s = summary
    lines = [
        f"trained {s['train_seconds']:.0f} s: {s['updates']:,} optimisation steps on {s['frames_consumed']:,} frames "
        f"from {s['batches_consumed']:,} spool batches (collected {s['frames_collected']:,}; "
        f"spool empty at the end: {'yes' if s['spool_empty'] else 'NO: ' + ', '.join(s['spool_leftovers'])})",
        f"versions published: {s['versions_published']} (v{s['first_version']}..v{s['final_version']}, "
        f"every {s['publish_every']} steps)",
    ]
    for name, r in sorted(s["collectors"].items()):
        at_latest = " (the latest)" if r["final_version"] == s["final_version"] else ""
        transports = ", ".join(f"{k} {v}" for k, v in sorted(r["transports"].items())) or "-"
        lines.append(
            f"{name}: applied {r['versions_applied']} versions, final v{r['final_version']}{at_latest}; "
            f"{r['frames']:,} frames in {r['batches']} batches, {r['episodes']} episodes; "
            f"fetched {_kb(r['fetched_bytes'])} ({transports})"
        )
    missing = s["collectors_expected"] - len(s["collectors"])
    if missing > 0:
        lines.append(f"{missing} collector(s) never reported")
    lag, stale = s["lag"], s["staleness"]
    lines.append(
        f"lag (server latest - applied, after each batch): max {lag['max']}, mean {_num(lag['mean'], 2)}; "
        f"data age when consumed (latest published - version that collected it): max {stale['max']}, "
        f"mean {_num(stale['mean'], 1)} versions"
    )
    fresh = s.get("freshness") or {}
    lines.append(
        f"freshness (publish call -> collector applied, pulled before each batch): p50 {_num(fresh.get('p50_ms'), 1)} "
        f"ms, max {_num(fresh.get('max_ms'), 1)} ms over {fresh.get('samples', 0)} updates"
    )
    lines.append(f"bytes served to collectors: {_kb(s['bytes_served'])}")
    r = s["reward"]
    if r["quarters"]:
        trend = " -> ".join(f"{q:.0f}" for q in r["quarters"])
        lines.append(
            f"episode reward (mean per quarter of {r['episodes']} episodes, 200 steps each): {trend}; "
            f"first -> last quarter {r['last_quarter'] - r['first_quarter']:+.0f}; "
            f"first 10 episodes {r['first_10']:.0f}, last 10 {r['last_10']:.0f}, best {r['best_episode']:.0f}"
        )
    else:
        lines.append("episode reward: no episode finished")
    return "\n".join(f"summary      {line}" for line in lines)
