"""The result table (stdout) and the JSON file with every raw sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import Row, format_size

COLUMNS = ("row", "size", "median", "[min - max]", "unit", "baseline (median, same run)", "ratio", "target", "result")


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _cells(row: Row) -> tuple[str, ...]:
    size = format_size(row.size) if row.size else "tiny" if row.name == "watch_latency" else "-"
    if row.status != "ok" or not row.samples:
        label, verdict = ("n/a (not implemented)", "n/a") if row.status == "n/a" else ("ERROR", "ERROR")
        return (row.name, size, label, "", row.unit, "-", "-", row.target or "-", verdict)
    spread = f"[{_number(min(row.samples))} - {_number(max(row.samples))}]"
    baseline = f"{row.baseline}: {_number(row.baseline_value)} {row.unit}" if row.baseline else "-"
    ratio = f"{_number(row.ratio)}x" if row.ratio is not None else "-"
    result = "-" if row.passed is None else "PASS" if row.passed else "FAIL"
    return (row.name, size, _number(row.median), spread, row.unit, baseline, ratio, row.target or "-", result)


def format_table(rows: list[Row]) -> str:
    """Baselines first, then the rows; one line each, columns aligned; notes underneath."""
    lines = [COLUMNS]
    baselines = [r for r in rows if r.kind == "baseline"]
    measured = [r for r in rows if r.kind != "baseline"]
    for group in (baselines, measured):
        lines.extend(_cells(r) for r in group)
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]

    def render(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    out = [render(COLUMNS), "  ".join("-" * w for w in widths)]
    out.extend(render(_cells(r)) for r in baselines)
    if baselines and measured:
        out.append("")
    out.extend(render(_cells(r)) for r in measured)
    notes = [f"  {r.name} {format_size(r.size) if r.size else ''}: {r.note}".rstrip() for r in rows if r.note]
    if notes:
        out += ["", "notes:", *notes]
    return "\n".join(out)


def write_json(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    """Every row with its raw samples, median, min, max, ratio and verdict, plus run metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "rows": [r.as_dict() for r in rows]}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
