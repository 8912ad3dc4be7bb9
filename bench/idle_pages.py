"""What touching memory again costs on this machine, by how long it sat untouched: a probe, not a row.

    .venv/bin/python -m bench.idle_pages [--size 16MiB] [--gaps 0.01,0.1,0.3,1] [--repeats 6]

Each round maps a fresh shared-memory file of `--size` (a memfd, as an upload is), fills its page table
(`page_tables.populate`, as a spare upload does), waits `gap` seconds with the CPU busy, then writes one
byte in each page. On a plain machine that costs the same after any gap. On a VM whose host (or a
DAMON `pageout` scheme) takes pages back, it grows with the gap: every page faults again, and the
16 MiB rows after idle (`memcpy_after_idle`, `publish_shm`, `torchrl_shared_mem`) pay for it. Run it
before a full bench run to know which kind of machine the figures will come from.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

from bench.common import format_size, parse_size
from weightserver.protocol import page_tables


def touch_after(size: int, gap: float) -> float:
    """Milliseconds to write one byte per page of a populated `size`-byte memfd mapping, `gap` s after populating."""
    fd = os.memfd_create("weightserver-idle-pages")
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    with mapping:
        page_tables.populate(mapping)
        until = time.perf_counter() + gap
        while time.perf_counter() < until:  # busy: an idle vCPU is not what is measured
            pass
        start = time.perf_counter()
        for offset in range(0, size, mmap.PAGESIZE):
            mapping[offset] = 1
        return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("16MiB"), help="mapping size (default 16MiB)")
    parser.add_argument("--gaps", default="0.01,0.1,0.3,1", help="seconds untouched, comma-separated")
    parser.add_argument("--repeats", type=int, default=6, help="rounds per gap (default 6)")
    args = parser.parse_args(argv)
    pages = args.size // mmap.PAGESIZE
    print(f"writing one byte in each of {pages} pages ({format_size(args.size)}) of a populated memfd mapping")
    for gap in (float(g) for g in args.gaps.split(",")):
        times = [touch_after(args.size, gap) for _ in range(args.repeats)]
        median = statistics.median(times)
        print(f"after {gap:g} s untouched: median {median:.3g} ms ({median * 1e3 / pages:.3g} us a page)")


if __name__ == "__main__":
    main()
