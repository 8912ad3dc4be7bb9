"""BackgroundPublisher: publish snapshots from a thread, one at a time, without blocking the
trainer. A newer submit replaces a snapshot still waiting (`superseded`: its future gets the
version that carried it). Sent buffers are reused (`spare_buffer`): no fresh page faults.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from weightclient.core.latest_only_worker import LatestOnlyWorker

log = logging.getLogger(__name__)


class PublishFuture(Future):
    superseded: bool = False  # a newer submit replaced this snapshot before it was sent


@dataclass
class _Job:
    snapshot: Mapping[str, memoryview]
    options: dict
    futures: list[PublishFuture] = field(default_factory=list)


class BackgroundPublisher:
    """Runs `send(snapshot, **options) -> version` for submitted snapshots, one at a time."""

    def __init__(self, send: Callable[..., int]) -> None:
        self._send = send
        self._spares: list[memoryview] = []  # buffers of snapshots sent or replaced
        self._spares_lock = threading.Lock()
        self._worker = LatestOnlyWorker(self._publish, "weightclient-publisher")

    def submit(self, snapshot: Mapping[str, memoryview], **options) -> PublishFuture:
        future = PublishFuture()
        if not self._worker.put(_Job(snapshot, options, [future]), merge=self._coalesce):
            raise RuntimeError("the background publisher is closed")
        return future

    def spare_buffer(self) -> memoryview | None:
        with self._spares_lock:
            return self._spares.pop() if self._spares else None

    def flush(self, timeout: float | None = None) -> bool:
        return self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._worker.flush(timeout)
        self._worker.close(timeout)

    def _coalesce(self, waiting: _Job, newer: _Job) -> _Job:
        log.debug("coalescing %d waiting publish(es) into the newest", len(waiting.futures))
        for older in waiting.futures:
            older.superseded = True
        self._recycle(waiting.snapshot)
        newer.futures[:0] = waiting.futures
        return newer

    def _publish(self, job: _Job) -> None:
        try:
            version, error = self._send(job.snapshot, **job.options), None
        except BaseException as exc:  # handed to the caller through the futures
            log.error("background publish failed: %s", exc)
            version, error = None, exc
        # Recycle first, so a caller woken by its future finds the buffer ready for reuse.
        self._recycle(job.snapshot)
        for future in job.futures:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(version)

    def _recycle(self, snapshot: Mapping[str, memoryview]) -> None:
        with self._spares_lock:
            self._spares.extend(snapshot.values())
            self._spares[:] = sorted(self._spares, key=lambda b: b.nbytes)[-4:]  # keep a few, largest
