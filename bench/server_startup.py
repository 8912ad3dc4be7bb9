"""Time from launching `weightserver serve` to its health service answering SERVING.

    .venv/bin/python bench/server_startup.py [--runs 9]

Prints the median and min-max over the runs, next to the time to start a bare Python
interpreter (`python -c pass`) measured in the same run as the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from weightserver.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    runs = parser.parse_args().runs
    bare, serve = [], []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        server = ServerProcess().start()
        serve.append(time.perf_counter() - start)
        server.stop()
    for name, values in (("python -c pass", bare), ("weightserver serve -> SERVING", serve)):
        print(
            f"{name:32s} median {statistics.median(values) * 1e3:7.1f} ms  "
            f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f}, {runs} runs)"
        )
    print(f"ratio serve / bare interpreter: {statistics.median(serve) / statistics.median(bare):.1f}x")


if __name__ == "__main__":
    main()
