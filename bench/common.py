"""Shared pieces of the benchmark suite: sizes, the Row record, stderr logging, /proc readers.

Standard library only: every benchmark child process (spawned) imports this module, and the
lighter ones never import torch.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
MB = 1_000_000  # memory rows report decimal megabytes, as the targets are written
# Untimed rounds before the timed ones, the same for our transfers and the baselines they are
# compared with: the first transfers pay one-off costs (page faults, TCP windows, Python call
# paths warming up; ours settled after about 3 fetches) that a long-running collector does not.
WARMUP_ROUNDS = 3

_START = time.perf_counter()
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "kb": 1000, "mb": MB, "gb": 1000 * MB}


def log(message: str) -> None:
    """A progress line on stderr, stamped with the seconds since the suite started."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """'16MiB' -> 16777216; also KiB, GiB, KB, MB, GB and plain byte counts."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 16MiB, 256MiB, 1GiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def format_size(nbytes: int | None) -> str:
    """16777216 -> '16MiB' (binary units, as the sizes are given)."""
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Row:
    """One line of the result table: samples of one quantity, and how it compares.

    `samples` are in `unit`; the table shows their median and min-max. `ratio` is computed
    against `baseline_value` (the baseline's median, measured in the same run) and `passed`
    judges it against `target`. `status` is "ok", "n/a" (feature absent: no number is made
    up) or "error" (the measurement failed; `note` says why).
    """

    name: str
    size: int | None
    unit: str
    samples: list[float] = field(default_factory=list)
    kind: str = "row"  # "row" or "baseline"
    baseline: str | None = None
    baseline_value: float | None = None
    ratio: float | None = None
    target: str = ""
    passed: bool | None = None
    status: str = "ok"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def judge(self, ratio: float | None, op: str, threshold: float, target: str | None = None) -> Row:
        """Set `ratio` and whether `ratio op threshold` holds ('>=' or '<=')."""
        self.ratio = ratio
        self.target = target or f"ratio {op} {threshold:g}x"
        if ratio is not None:
            self.passed = ratio >= threshold if op == ">=" else ratio <= threshold
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "size_bytes": self.size,
            "size": format_size(self.size),
            "unit": self.unit,
            "status": self.status,
            "samples": self.samples,
            "median": self.median,
            "min": min(self.samples) if self.samples else None,
            "max": max(self.samples) if self.samples else None,
            "baseline": self.baseline,
            "baseline_median": self.baseline_value,
            "ratio": self.ratio,
            "target": self.target,
            "passed": self.passed,
            "note": self.note,
            "extra": self.extra,
        }


def not_available(name: str, size: int | None, unit: str, target: str, why: str) -> Row:
    """A row whose feature does not exist yet: printed as n/a, never as a number."""
    return Row(name, size, unit, status="n/a", target=target, note=why)


# ---------------------------------------------------------------------- /proc readers
def _status_field(pid: int | str, key: str) -> int:
    """A `kB` field of /proc/<pid>/status (VmRSS, VmHWM) in bytes; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU time (user + system) a process has used so far, in seconds; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size (VmRSS) of a process, in bytes."""
    return _status_field(pid, "VmRSS")


def hwm_bytes(pid: int | str = "self") -> int:
    """Peak resident set size since the process started (VmHWM), in bytes."""
    return _status_field(pid, "VmHWM")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs so far, from /proc/stat (busy: not idle, not I/O wait)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_since(before: tuple[int, int]) -> float:
    """Fraction of all CPUs busy since `before` (a `cpu_ticks()` reading)."""
    busy, total = cpu_ticks()
    return (busy - before[0]) / max(1, total - before[1])


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy (not idle, not I/O wait) over `seconds`, from /proc/stat.

    A better sign of competing work than the load average, which here also counts tasks
    blocked on I/O.
    """
    before = cpu_ticks()
    time.sleep(seconds)
    return busy_since(before)


class PeakRss:
    """Samples a process's VmRSS from a thread every `interval` seconds; `.peak` is the max.

    >>> with PeakRss(os.getpid()) as sampler:   # doctest: +SKIP
    ...     work()
    >>> sampler.peak
    """

    def __init__(self, pid: int | str = "self", interval: float = 0.02) -> None:
        self.pid = os.getpid() if pid == "self" else pid
        self.interval = interval
        self.peak = 0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, rss_bytes(self.pid))
        self.count += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
