"""A pool of long-lived fetching processes, started once and driven by commands.

Used by the fan-out row (8 collectors with `WeightClient`) and the server-memory row (16
byte-level fetchers). Synchronized rounds release every worker through one barrier.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import time
from types import TracebackType
from typing import Any

from bench import workers

SPAWN = multiprocessing.get_context("spawn")


class FetchPool:
    """`count` processes, each with its own client of the server at `address`."""

    def __init__(
        self,
        count: int,
        address: str,
        *,
        use_torch: bool,
        warm_model: str | None = None,
        fetch_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.count = count
        self.results = SPAWN.Queue()
        self.barrier = SPAWN.Barrier(count)
        self.commands = [SPAWN.Queue() for _ in range(count)]
        self.processes = [
            SPAWN.Process(
                target=workers.fetch_worker,
                args=(
                    i,
                    address,
                    use_torch,
                    warm_model,
                    fetch_kwargs or {},
                    self.commands[i],
                    self.results,
                    self.barrier,
                ),
                daemon=True,
                name=f"bench-fetcher-{i}",
            )
            for i in range(count)
        ]

    def start(self, timeout: float = 180.0) -> FetchPool:
        for process in self.processes:
            process.start()
        for message in self._collect(self.count, timeout):
            if message[0] != "ready":
                raise RuntimeError(f"unexpected message from a fetcher: {message!r}")
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def fetch_one(
        self, index: int, model: str, version: int, timeout: float = 300.0, **kwargs: Any
    ) -> tuple[int, int, int, int, str]:
        """Worker `index` alone fetches once (`kwargs` added to its fetch's); returns (index, start_ns,
        end_ns, bytes, transport)."""
        self._send(index, ("fetch", model, version, False, kwargs))
        return self._collect(1, timeout)[0]

    def fetch_all(
        self, model: str, version: int, timeout: float = 600.0, each: list[dict[str, Any]] | None = None
    ) -> list[tuple[int, int, int, int, str]]:
        """Every worker fetches at once (released together by the barrier); worker i adds `each[i]`."""
        for i in range(self.count):
            self._send(i, ("fetch", model, version, True, each[i] if each else {}))
        return self._collect(self.count, timeout)

    def _send(self, index: int, command: tuple) -> None:
        """A queue pickles in a thread of its own, where a failure is printed and the worker waits
        forever: pickled here first, a command that cannot be sent raises in the caller."""
        pickle.dumps(command)
        self.commands[index].put(command)

    def _collect(self, count: int, timeout: float) -> list:
        collected = []
        deadline = time.monotonic() + timeout
        while len(collected) < count:
            try:
                collected.append(self.results.get(timeout=1.0))
                continue
            except queue.Empty:
                pass
            dead = [p.name for p in self.processes if not p.is_alive()]
            if dead:
                raise RuntimeError(f"fetchers died: {', '.join(dead)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count - len(collected)} fetchers did not report within {timeout}s")
        return collected

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)

    def __enter__(self) -> FetchPool:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
