"""PNG charts of a results file (the JSON `bench/run.py --json` writes), drawn with matplotlib.

    python -m bench.plots bench/results.json [RERUN.json ...] --out DIR

writes into DIR (`bench/run.py` writes them beside its `--json` file unless `--no-plots`):

- `bench-freshness.png`: the freshness rows (publish call -> collectors hold the version: every
  `freshness*` row, `fanout_tree*`, `relay_follow*`), in ms, per model size;
- `bench-throughput.png`: the GB/s rows (fetches, fan-out) and the publish rows, whose ms are
  drawn as model bytes / time, per model size;
- `bench-trace-bytes.png`: the bytes each version of the training traces sent (`trace_*_delta`,
  from their `extra.versions`): whole, tensor-level delta, element delta, and the forms compared.

Each row is drawn beside its own baseline's median, measured in the same run (`baseline_median`),
with the value its target allows marked where the target is a ratio of medians, and FAIL written
beside a row that missed it. A row that errored, is n/a or has no positive median is left out,
listed under its chart and logged. With several files, a later file's rows replace the earlier
files' rows of the same name and size (a rerun of some rows with `--only`); each chart names them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/plots.py` as well as `python -m bench.plots`

from bench.common import format_size, log  # noqa: E402
from bench.trace_rows import ROWS as TRACE_ROWS  # noqa: E402

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn: bench/run.py imports this lazily
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FRESHNESS_CHART = "bench-freshness.png"
THROUGHPUT_CHART = "bench-throughput.png"
TRACE_CHART = "bench-trace-bytes.png"
FRESHNESS_PREFIXES = ("freshness", "fanout_tree", "relay_follow")
# Timed in ms, drawn in GB/s (model bytes / time) beside the fetch rows; their targets are on the time.
PUBLISH_ROWS = ("publish_blocked", "publish_blocked_async", "publish_bulk", "publish_shm")
# The GB/s rows by name too: a row that failed has no unit ("-"), and is listed as left out.
RATE_ROWS = ("fetch_live_policy", "fetch_shm_vs_gloo", "fanout_8")
DPI = 100
WIDTH = 11.0  # inches
COLOURS = {"PASS": "#2a9d4b", "FAIL": "#d62728", "": "#3b75af", "baseline": "#a6a6a6"}
_RATIO_TARGET = re.compile(r"^ratio\s*(<=|>=)\s*([0-9.]+)x")


@dataclass
class Bar:
    """One row at one size as drawn: its median and min-max, its baseline's median, its target."""

    name: str
    size: int | None
    value: float
    low: float
    high: float
    unit: str
    baseline: str | None
    baseline_value: float | None
    ratio: float | None
    target: str
    verdict: str  # "PASS", "FAIL", or "" (not judged)
    allowed: float | None  # the value the target allows, in `unit` (None: not a ratio of medians)
    converted: bool = False  # timed in ms, drawn in GB/s


@dataclass
class Chart:
    """A written chart: its file, the rows drawn on it and those left out (with why)."""

    path: Path
    drawn: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ the rows
def check_results(results: Any, source: str) -> list[dict[str, Any]]:
    """The rows of a results dict; ValueError naming `source` when it is not one."""
    if not isinstance(results, Mapping) or not isinstance(results.get("rows"), list):
        raise ValueError(
            f"{source}: not a bench results file: expected {{'meta': {{...}}, 'rows': [...]}} "
            "as `bench/run.py --json FILE` writes"
        )
    return list(results["rows"])


def merge(files: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of every (source, results) in order, a later file's rows replacing the earlier
    files' of the same name and size; and a line per source (file, commit, when)."""
    rows: list[dict[str, Any]] = []
    sources = []
    for source, results in files:
        new = check_results(results, source)
        keys = {(r.get("name"), r.get("size_bytes")) for r in new}
        rows = [r for r in rows if (r.get("name"), r.get("size_bytes")) not in keys] + new
        meta = results.get("meta") or {}
        head = str(meta.get("git_head") or "")[:7] + ("-dirty" if meta.get("git_dirty") else "")
        when = ", ".join(str(v) for v in (head, meta.get("finished")) if v)
        sources.append(f"{source} ({when})" if when else source)
    return rows, sources


def _verdict(row: Mapping[str, Any]) -> str:
    return {True: "PASS", False: "FAIL"}.get(row.get("passed"), "")


def _label(row: Mapping[str, Any]) -> str:
    return f"{row.get('name')} {format_size(row.get('size_bytes')) if row.get('size_bytes') else ''}".strip()


def usable(row: Mapping[str, Any]) -> str:
    """Why a row cannot be drawn ("" when it can)."""
    if row.get("status", "ok") != "ok":
        note = str(row.get("note") or "").strip()
        return f"{row.get('status')}{': ' + note[:70] if note else ''}"
    median = row.get("median")
    if not isinstance(median, (int, float)):
        return "no samples"
    if median <= 0:
        return f"median {median:.3g} {row.get('unit')}: not positive (log scale)"
    return ""


def _allowed(row: Mapping[str, Any], invert: bool = False) -> float | None:
    """The value the row's target allows, when the target is a ratio of the row's median to its
    baseline's (`ratio <= 1.3x`); in GB/s for a timed row drawn as throughput (`invert`)."""
    match = _RATIO_TARGET.match(str(row.get("target") or ""))
    base = row.get("baseline_median")
    if not match or not isinstance(base, (int, float)) or base <= 0:
        return None
    threshold = float(match.group(2))
    return base * threshold if not invert else row["size_bytes"] / (base * threshold) / 1e6


def _bar(row: Mapping[str, Any], as_rate: bool = False) -> Bar:
    """A row as drawn; `as_rate`: a row timed in ms drawn as its model bytes / time, in GB/s."""
    size, base = row.get("size_bytes") or None, row.get("baseline_median")
    value, low, high = row["median"], row["min"], row["max"]
    if as_rate:  # the slowest sample is the lowest rate
        value, low, high = (size / ms / 1e6 for ms in (value, high, low))
        base = size / base / 1e6 if isinstance(base, (int, float)) and base > 0 else None
    return Bar(
        name=row["name"],
        size=size,
        value=value,
        low=low,
        high=high,
        unit="GB/s" if as_rate else str(row.get("unit")),
        baseline=row.get("baseline"),
        baseline_value=base,
        ratio=row.get("ratio"),
        target=str(row.get("target") or ""),
        verdict=_verdict(row),
        allowed=_allowed(row, invert=as_rate),
        converted=as_rate,
    )


def freshness_bars(rows: Iterable[Mapping[str, Any]]) -> tuple[list[Bar], list[str]]:
    """The freshness rows as bars in ms, and the ones left out (with why)."""
    bars, skipped = [], []
    for row in rows:
        ours = str(row.get("name")).startswith(FRESHNESS_PREFIXES) and row.get("unit") in ("ms", "-")
        if row.get("kind") == "row" and ours:  # "-": a failed row's unit
            why = usable(row)
            if why:
                skipped.append(f"{_label(row)} ({why})")
            else:
                bars.append(_bar(row))
    return bars, skipped


def throughput_bars(rows: Iterable[Mapping[str, Any]]) -> tuple[list[Bar], list[str]]:
    """The GB/s rows, and the publish rows (ms) as model bytes / time in GB/s; the ones left out."""
    bars, skipped = [], []
    for row in rows:
        timed = row.get("name") in PUBLISH_ROWS
        if row.get("kind") == "row" and (timed or row.get("name") in RATE_ROWS or row.get("unit") == "GB/s"):
            why = usable(row)
            if not why and timed and (row.get("unit") != "ms" or not row.get("size_bytes")):
                why = f"in {row.get('unit')}, size {row.get('size_bytes')}: not drawable as bytes / time"
            if why:
                skipped.append(f"{_label(row)} ({why})")
            else:
                bars.append(_bar(row, as_rate=timed))
    return bars, skipped


# ------------------------------------------------------------------------------------ drawing
def _new_figure(height: float, footer: Iterable[str]) -> Figure:
    """A figure `height` inches tall plus the footer's lines (sources, notes, rows left out) under
    the area the layout fills."""
    from matplotlib.figure import Figure

    lines = [wrapped for line in footer if line for wrapped in textwrap.wrap(line, 170)]
    below = 0.1 + 0.12 * len(lines)  # inches: 7 pt lines
    figure = Figure(figsize=(WIDTH, height + below), dpi=DPI, layout="constrained")
    figure.get_layout_engine().set(rect=(0, below / (height + below), 1, 1 - below / (height + below)))
    figure.text(0.01, 0.05 / (height + below), "\n".join(lines), fontsize=7, va="bottom", color="#444444")
    return figure


def _number(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _nothing(figure: Figure, message: str) -> None:
    axes = figure.add_subplot()
    axes.set_axis_off()
    axes.text(0.5, 0.5, message, ha="center", va="center", fontsize=13, transform=axes.transAxes)


def _size_groups(bars: list[Bar]) -> list[tuple[str, list[Bar]]]:
    sizes = sorted({b.size for b in bars if b.size}) + ([None] if any(not b.size for b in bars) else [])
    return [
        (
            f"{format_size(s)} model" if s else "rows with a model of their own (see the row's name)",
            [b for b in bars if b.size == s],
        )
        for s in sizes
    ]


def _beside(axes: Axes, y: float, text: str, points: float, **style: Any) -> None:
    """`text` right of the axes at height `y` (data), `points` from its edge."""
    from matplotlib.transforms import blended_transform_factory

    at = blended_transform_factory(axes.transAxes, axes.transData)
    axes.annotate(
        text, (1, y), xycoords=at, xytext=(points, 0), textcoords="offset points", va="center", fontsize=8, **style
    )


def _draw_bars(axes: Axes, bars: list[Bar], log_scale: bool) -> None:
    """Per bar: the row's median with a min-max whisker over its baseline's median (grey), the
    value the target allows (a black tick), and the figures in a column right of the axes."""
    height = 0.38
    for i, bar in enumerate(bars):
        y = -i
        whisker = [[bar.value - bar.low], [bar.high - bar.value]]
        axes.barh(
            y + height / 2,
            bar.value,
            height,
            color=COLOURS[bar.verdict],
            xerr=whisker,
            error_kw={"elinewidth": 1, "capsize": 2, "ecolor": "#333333"},
        )
        figures = f"{_number(bar.value)} {bar.unit}"
        if bar.ratio is not None:
            figures += f"  {bar.ratio:.3g}x"
        if bar.verdict:
            figures += f"  (target {bar.target})"
            _beside(axes, y + height / 2, bar.verdict, 4, fontweight="bold", color=COLOURS[bar.verdict])
        _beside(axes, y + height / 2, figures, 32)
        if bar.baseline_value is not None:
            axes.barh(y - height / 2, bar.baseline_value, height, color=COLOURS["baseline"])
            label = f"{bar.baseline}: {_number(bar.baseline_value)} {bar.unit}"
            _beside(axes, y - height / 2, label, 32, color="#555555")
        if bar.allowed is not None:
            axes.plot([bar.allowed], [y + height / 2], marker="|", markersize=13, markeredgewidth=2, color="black")
    axes.set_yticks([-i for i in range(len(bars))], [b.name + (" *" if b.converted else "") for b in bars], fontsize=9)
    axes.set_ylim(-len(bars) + 0.4, 0.6)
    if log_scale:
        axes.set_xscale("log")
    axes.grid(axis="x", which="both", color="#e6e6e6", linewidth=0.6)
    axes.set_axisbelow(True)


def _legend(axes: Axes, bars: list[Bar]) -> None:
    """The key, alone in `axes` (a row of the layout of its own, so nothing overlaps it)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shown = {b.verdict for b in bars}
    keys = (("PASS", "row, met its target"), ("FAIL", "row, missed its target"), ("", "row, not judged"))
    handles: list[Any] = [Patch(color=COLOURS[v], label=label) for v, label in keys if v in shown]
    handles.append(Patch(color=COLOURS["baseline"], label="baseline, same run"))
    if any(b.allowed is not None for b in bars):
        tick = {"marker": "|", "markersize": 11, "markeredgewidth": 2, "color": "black", "linestyle": ""}
        handles.append(Line2D([], [], label="what the target allows", **tick))
    axes.set_axis_off()
    axes.legend(handles=handles, loc="center", ncols=len(handles), fontsize=8, frameon=False)


def bar_chart(
    path: Path, title: str, unit: str, bars: list[Bar], skipped: list[str], sources: list[str], notes: list[str]
) -> Chart:
    """Bars per model size, one panel per size, on a log scale when the values span decades."""
    groups = _size_groups(bars)
    left_out = f"Left out: {'; '.join(skipped)}." if skipped else ""
    footer = [f"From {', '.join(sources)}.", *notes, left_out]
    figure = _new_figure(1.9 + sum(0.45 * len(g) + 0.6 for _, g in groups) if groups else 4.0, footer)
    figure.suptitle(title, fontsize=12, fontweight="bold")
    if groups:
        values = [v for b in bars for v in (b.low, b.high, b.baseline_value, b.allowed) if v]
        log_scale = max(values) / min(values) > 20
        heights = [len(g) + 1 for _, g in groups] + [0.6]  # the last row: the key
        panels = figure.subplots(len(groups) + 1, 1, squeeze=False, height_ratios=heights)[:, 0]
        for axes, (label, group) in zip(panels, groups, strict=False):
            _draw_bars(axes, group, log_scale)
            axes.set_title(label, loc="left", fontsize=10)
            axes.set_xlim(min(values) / 1.5 if log_scale else 0, max(values) * (1.5 if log_scale else 1.08))
        panels[-2].set_xlabel(f"{unit} (median of the repeats, whisker: min-max)")
        _legend(panels[-1], bars)
    else:
        _nothing(figure, "no rows of this chart in the results" + (" (all left out: see below)" if skipped else ""))
    return _save(figure, path, [f"{b.name} {format_size(b.size) if b.size else ''}".strip() for b in bars], skipped)


def _save(figure: Figure, path: Path, drawn: list[str], skipped: list[str]) -> Chart:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image  # matplotlib's own dependency

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(256).save(path, optimize=True)  # a palette: a third of the bytes, no visible loss
    if skipped:
        log(f"{path.name}: left out {'; '.join(skipped)}")
    log(f"wrote {path} ({len(drawn)} rows drawn)")
    return Chart(path, drawn, skipped)


def _bytes(value: float, _position: object = None) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


# Per version of a trace row (extra.versions): the series drawn, label -> (getter, style).
TRACE_SERIES: dict[str, tuple[Callable[[Mapping[str, Any]], Any], dict[str, Any]]] = {
    "tensor-level delta (changed tensors whole)": (
        lambda v: v.get("tensor_delta_wire_bytes"),
        {"color": "#7f7f7f", "marker": "s"},
    ),
    "element delta (what the server sent)": (
        lambda v: v.get("delta_wire_bytes"),
        {"color": "#3b75af", "marker": "o", "linewidth": 2.2},
    ),
    "sparse form alone (changed tensors)": (
        lambda v: v.get("sparse_only_bytes"),
        {"color": "#e39a2d", "linestyle": "--", "marker": "."},
    ),
    "bitmap form alone (changed tensors)": (
        lambda v: v.get("bitmap_only_bytes"),
        {"color": "#9467bd", "linestyle": "--", "marker": "."},
    ),
    "XOR + zlib (tensors only, no header)": (
        lambda v: (v.get("xor_zlib") or {}).get("bytes"),
        {"color": "#2a9d4b", "linestyle": ":", "marker": "^"},
    ),
}


def _trace_panel(axes: Axes, row: Mapping[str, Any]) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    versions = [v for v in row["extra"]["versions"] if isinstance(v, Mapping) and "version" in v]
    numbers = [v["version"] for v in versions]
    full = row["extra"].get("full_wire_bytes")
    if full:
        axes.axhline(full, color="black", linewidth=1.6, label=f"whole version (full fetch): {_bytes(full)}")
    for label, (get, style) in TRACE_SERIES.items():
        points = [(n, get(v)) for n, v in zip(numbers, versions, strict=True) if get(v)]
        if points:
            axes.plot(*zip(*points, strict=True), label=label, **style)
    match = _RATIO_TARGET.match(str(row.get("target") or ""))
    if full and match and match.group(1) == ">=":
        allowed = full / float(match.group(2))
        axes.axhline(
            allowed, color=COLOURS["FAIL"], linestyle="-.", linewidth=1, label=f"target: whole / {match.group(2)}"
        )
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(FuncFormatter(_bytes))
    low, high = axes.get_ylim()
    # Within a decade a log axis has no major tick to label: label the minor ones then.
    axes.yaxis.set_minor_formatter(FuncFormatter(_bytes) if high / low < 10 else NullFormatter())
    axes.set_xticks(numbers)
    axes.set_xlabel("version (each a delta against the previous one)")
    axes.set_ylabel("bytes per version")
    axes.grid(which="major", color="#e6e6e6", linewidth=0.6)
    verdict = _verdict(row)
    judged = f"; target {row.get('target')}: {verdict}" if verdict else ""
    what = row["extra"].get("what") or ""
    title = f"{row['name']}: {what}\nwhole / element delta, median {row['median']:.3g}x{judged}"
    axes.set_title(
        "\n".join(textwrap.fill(line, 70) for line in title.splitlines()),
        loc="left",
        fontsize=10,
        color=COLOURS["FAIL"] if verdict == "FAIL" else "black",
    )
    axes.legend(fontsize=7, loc="best")


def trace_chart(path: Path, rows: list[dict[str, Any]], sources: list[str]) -> Chart:
    """One panel per training trace: bytes per version, log scale."""
    found = {r.get("name"): r for r in rows if r.get("name") in TRACE_ROWS}
    drawn, skipped = [], []
    for name in TRACE_ROWS:
        row = found.get(name)
        why = "not in the results" if row is None else usable(row)
        if not why and not (row.get("extra") or {}).get("versions"):
            why = "no per-version bytes in its extra"
        if why:
            skipped.append(f"{name} ({why})")
        else:
            drawn.append(name)
    left_out = f"Left out: {'; '.join(skipped)}." if skipped else ""
    bytes_are = "Wire bytes of each fetch with base= the previous version (bench/trace_rows.py)."
    figure = _new_figure(5.2, [f"From {', '.join(sources)}.", bytes_are, left_out])
    figure.suptitle(
        "Training traces: bytes sent per version, whole against element deltas", fontsize=12, fontweight="bold"
    )
    if drawn:
        panels = figure.subplots(1, len(drawn), squeeze=False)[0]
        for axes, name in zip(panels, drawn, strict=True):
            _trace_panel(axes, found[name])
    else:
        _nothing(figure, "no trace rows to draw: " + "; ".join(skipped))
    return _save(figure, path, drawn, skipped)


# ------------------------------------------------------------------------------------ entry points
def write_charts(rows: list[dict[str, Any]], out: Path, sources: list[str]) -> list[Chart]:
    """The three charts of `rows` into `out`; rows that cannot be drawn are listed, never fatal."""
    fresh, fresh_skipped = freshness_bars(rows)
    rates, rates_skipped = throughput_bars(rows)
    return [
        bar_chart(
            out / FRESHNESS_CHART,
            "Freshness: publish call -> every collector holds the version",
            "ms",
            fresh,
            fresh_skipped,
            sources,
            ["Each row beside the baseline it is judged against, measured in the same run; lower is better."],
        ),
        bar_chart(
            out / THROUGHPUT_CHART,
            "Throughput: fetches, fan-out and publishes",
            "GB/s",
            rates,
            rates_skipped,
            sources,
            [
                "Each row beside the baseline it is judged against, measured in the same run; higher is better. "
                "* timed in ms, drawn as model bytes / time: their ratios and targets are on the time (lower: better)."
            ],
        ),
        trace_chart(out / TRACE_CHART, rows, sources),
    ]


def plot_files(paths: Sequence[Path], out: Path) -> list[Chart]:
    """The charts of one or more results files (later files' rows replace earlier ones)."""
    files = []
    for path in paths:
        try:
            results = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
        files.append((str(path), results))
    rows, sources = merge(files)
    return write_charts(rows, out, sources)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plots",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[4:12]),
    )
    parser.add_argument("results", nargs="+", type=Path, help="results JSON file(s); later ones replace rows")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: the first file's)")
    args = parser.parse_args(argv)
    try:
        plot_files(args.results, args.out or args.results[0].parent)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"bench.plots: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
