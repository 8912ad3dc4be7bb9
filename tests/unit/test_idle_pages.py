"""bench/idle_pages.py, the probe of what touching memory again costs after a gap: one line per gap,
its per-page figure the median over the pages of the mapping."""

from __future__ import annotations

import re

from bench import idle_pages


def test_the_probe_prints_each_gap_with_its_median_and_per_page_cost(capsys):
    idle_pages.main(["--size", "256KiB", "--gaps", "0,0.02", "--repeats", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "writing one byte in each of 64 pages (256KiB) of a populated memfd mapping"
    gaps = []
    for line in lines[1:]:
        found = re.fullmatch(r"after (\S+) s untouched: median (\S+) ms \((\S+) us a page\)", line)
        assert found, line
        gap, median, per_page = found.groups()
        gaps.append(gap)
        assert float(median) > 0
        assert abs(float(per_page) / (float(median) * 1e3 / 64) - 1) < 0.02  # (both printed to 3 digits)
    assert gaps == ["0", "0.02"]


def test_a_round_waits_its_gap_before_the_timed_writes():
    import time

    started = time.perf_counter()
    took = idle_pages.touch_after(64 * 1024, 0.05)
    assert time.perf_counter() - started >= 0.05
    assert took < (time.perf_counter() - started) * 1e3
