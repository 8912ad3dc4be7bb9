"""Baselines, measured in the same run and at the same sizes as the rows compared to them.

- memcpy: torch `dst.copy_(src)` into a preallocated tensor, pages warmed first.
- memcpy_after_idle: the same, each copy after IDLE_GAP_SECONDS of idle, as the publish rows
  publish; `publish_shm` reports its ratio to it beside the judged one.
- raw_tcp: a separate sender process `sendall(memoryview)` of N bytes over loopback TCP; this
  process `recv_into` a preallocated buffer. Timed from the 1-byte 'go' to the last byte.
- raw_tcp_after_idle: the same, each transfer after IDLE_GAP_SECONDS of nothing, as the publish
  rows publish (a trainer trains between publishes). On the development machine a transfer
  after an idle second takes about twice as long as one right after another.
- raw_fanout: the freshness rows' topology with raw sockets: a sender, a forwarding process
  passing each MiB on as it arrives, 2 receivers `recv_into` a tensor (bench/raw_fanout.py).
- gloo_broadcast: torch.distributed gloo broadcast of N bytes between 2 spawned processes
  (one pair per size), timed on the receiving rank after a barrier.
- torchrl_shared_mem: TorchRL's own multiprocess weight sync (MultiSyncCollector, 2 workers,
  default SharedMemWeightSyncScheme), in a subprocess; see bench/torchrl_sync.py for what is
  timed. Each update after IDLE_GAP_SECONDS of idle, as the freshness rows publish; the same
  updates back to back are kept in `extra["hot_seconds"]`, and the rows report that ratio too.

Each returns a `Row` whose samples are GB/s (10^9 B/s) per repeat, raw seconds in
`extra["seconds"]`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import workers
from bench.common import WARMUP_ROUNDS, MiB, Row, gbps, log
from bench.raw_fanout import raw_fanout  # noqa: F401 (one of the suite's baselines, by name)

REPO = Path(__file__).resolve().parent.parent
SPAWN = multiprocessing.get_context("spawn")
MEMCPY_SAMPLE_BYTES = 256 * MiB


def throughput_row(name: str, nbytes: int, seconds: list[float], note: str = "", **extra: object) -> Row:
    """A baseline row in GB/s from per-repeat durations."""
    row = Row(name, nbytes, "GB/s", [gbps(nbytes, s) for s in seconds], kind="baseline", note=note)
    row.extra = {"seconds": seconds, **extra}
    return row


def median_seconds(row: Row) -> float:
    """The median duration of a baseline row (for time-based ratios)."""
    return statistics.median(row.extra["seconds"])


def memcpy(nbytes: int, repeats: int, *, idle: float = 0.0) -> Row:
    """torch `dst.copy_(src)` of `nbytes` (float32) into a preallocated, warmed tensor; `idle`
    seconds of nothing before each sample.

    Back to back, below 256 MiB a sample copies k distinct src/dst pairs (k * nbytes = 256 MiB,
    larger than the 32 MiB L3, so each copy starts cold as a one-off copy would) and divides by k:
    one preemption on a shared 2-core machine then does not decide a sub-millisecond sample.
    After idle, one pair: the idle leaves it cold.
    """
    import torch

    pairs = [
        (torch.full((nbytes // 4,), 1.5), torch.zeros(nbytes // 4))
        for _ in range(1 if idle else max(1, MEMCPY_SAMPLE_BYTES // nbytes))
    ]
    for src, dst in pairs:
        dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        time.sleep(idle)
        start = time.perf_counter()
        for src, dst in pairs:
            dst.copy_(src)
        seconds.append((time.perf_counter() - start) / len(pairs))
    note = f"torch copy_, {torch.get_num_threads()} threads, {len(pairs)} buffer pair(s) per sample"
    return throughput_row("memcpy", nbytes, seconds, note=note, pairs_per_sample=len(pairs))


def memcpy_after_idle(nbytes: int, repeats: int) -> Row:
    """`memcpy`, each copy after IDLE_GAP_SECONDS of idle."""
    row = memcpy(nbytes, repeats, idle=IDLE_GAP_SECONDS)
    row.name = "memcpy_after_idle"
    row.note += f", each after {IDLE_GAP_SECONDS:g} s idle"
    return row


IDLE_GAP_SECONDS = 1.0  # before each publish of the publish rows, and each raw_tcp_after_idle transfer


def raw_tcp_after_idle(nbytes: int, repeats: int) -> Row:
    """`raw_tcp`, each transfer after IDLE_GAP_SECONDS of idle."""
    row = raw_tcp(nbytes, repeats, idle=IDLE_GAP_SECONDS)
    row.name = "raw_tcp_after_idle"
    row.note += f", each after {IDLE_GAP_SECONDS:g} s idle"
    return row


def raw_tcp(nbytes: int, repeats: int, *, idle: float = 0.0) -> Row:
    """Loopback TCP: a spawned sender `sendall`s, this process `recv_into`s a preallocated
    buffer; `idle` seconds of nothing before each transfer."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sender = SPAWN.Process(target=workers.tcp_sender, args=(port, nbytes, repeats + WARMUP_ROUNDS), daemon=True)
        sender.start()
        listener.settimeout(60)
        conn, _ = listener.accept()
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    seconds = []
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(repeats + WARMUP_ROUNDS):
            time.sleep(idle)
            start = time.perf_counter()
            conn.sendall(b"g")
            received = 0
            while received < nbytes:
                got = conn.recv_into(view[received:], nbytes - received)
                if not got:
                    raise ConnectionError(f"sender closed after {received} of {nbytes} bytes")
                received += got
            if i >= WARMUP_ROUNDS:
                seconds.append(time.perf_counter() - start)
    sender.join(30)
    ok = buffer[0] == 0x5A and buffer[-1] == 0x5A
    return throughput_row("raw_tcp", nbytes, seconds, note="sendall(memoryview) -> recv_into", verified=ok)


def gloo_broadcast(nbytes: int, repeats: int) -> Row:
    """torch.distributed gloo broadcast of `nbytes` between two spawned processes (FileStore)."""
    with GlooPair(nbytes) as pair:
        for _ in range(WARMUP_ROUNDS):
            pair.round()
        seconds = [pair.round() for _ in range(repeats)]
        verified = pair.verified
    return throughput_row("gloo_broadcast", nbytes, seconds, note="2 processes, receiver timed", verified=verified)


class GlooPair:
    """Two spawned gloo ranks kept alive between broadcasts of `nbytes`: `round()` runs one
    broadcast and returns the receiver's duration in seconds."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.verified = True
        self._rounds = 0

    def __enter__(self) -> GlooPair:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-gloo-")
        self._results = SPAWN.Queue()
        self._commands = [SPAWN.Queue(), SPAWN.Queue()]
        init_file = os.path.join(self._tmp.name, "store")
        self._ranks = [
            SPAWN.Process(
                target=workers.gloo_rank,
                args=(rank, init_file, self.nbytes, self._commands[rank], self._results),
                daemon=True,
            )
            for rank in (0, 1)
        ]
        for rank in self._ranks:
            rank.start()
        return self

    def round(self) -> float:
        self._rounds += 1
        for commands in self._commands:
            commands.put(self._rounds)
        seconds, arrived = self._results.get(timeout=300)
        self.verified = self.verified and arrived
        return seconds

    def __exit__(self, *exc: object) -> None:
        for commands in self._commands:
            commands.put(None)
        for rank in self._ranks:
            rank.join(60)
            if rank.is_alive():
                rank.kill()
        self._tmp.cleanup()


def torchrl_shared_mem(sizes: list[int], repeats: int) -> list[Row]:
    """TorchRL MultiSyncCollector weight sync, one subprocess for all sizes (see torchrl_sync.py): each
    update after IDLE_GAP_SECONDS of idle, and (`extra["hot_seconds"]`) back to back."""
    command = [
        sys.executable,
        "-m",
        "bench.torchrl_sync",
        "--sizes",
        ",".join(str(s) for s in sizes),
        "--repeats",
        str(repeats),
        "--idle",
        str(IDLE_GAP_SECONDS),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore:Creating:DeprecationWarning"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    for line in done.stderr.splitlines():
        if line.startswith("[torchrl_sync]"):
            log(line)
    if done.returncode != 0:
        raise RuntimeError(f"torchrl_sync exited with {done.returncode}: {done.stderr[-2000:]}")
    rows = []
    for entry in json.loads(done.stdout.strip().splitlines()[-1]):
        row = throughput_row(
            "torchrl_shared_mem",
            entry["param_bytes"],  # GB/s from the bytes actually moved (N + 4)
            entry["seconds"],
            note=f"MultiSyncCollector(2 workers).update_policy_weights_(TD), each after {IDLE_GAP_SECONDS:g} s idle; "
            f"back to back: {statistics.median(entry['hot_seconds']) * 1e3:.2f} ms",
            **{k: v for k, v in entry.items() if k not in ("seconds", "nbytes")},
        )
        row.size = entry["nbytes"]
        rows.append(row)
    return rows
