"""BackgroundPublisher: publish without blocking the trainer.

`submit` snapshots the weights (the trainer may change its tensors once it returns) and
streams the snapshot from a background thread. One publish is in flight; a newer submit
replaces a snapshot still waiting (collectors want the newest weights), whose future resolves
to the version that carried them (`superseded`). A failure is set on every future it served.
Sent snapshot buffers are reused (`spare_buffer`): warm memory, no fresh page faults.
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
    """The version a background publish committed (`result()`), once it has."""

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
        """The buffer of an earlier snapshot, to copy the next one into, if there is one."""
        with self._spares_lock:
            return self._spares.pop() if self._spares else None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or in flight (every future resolved); False on timeout."""
        return self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, then stop the thread."""
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
