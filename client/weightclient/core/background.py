"""One daemon thread where only the newest item waiting matters: direct reads' reports, publishes off the trainer."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LatestOnlyWorker(Generic[T]):
    """`work(item)` for the items `put`, in a thread started on the first put (again in a fork)."""

    def __init__(self, work: Callable[[T], object], thread_name: str) -> None:
        self._work, self._thread_name = work, thread_name
        self._changed = threading.Condition()
        self._waiting: T | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def _in_this_process(self) -> None:
        """In a forked child, start empty: the parent's items are its own to send (a flush here would wait forever)."""
        if self._pid != os.getpid():
            self._pid, self._changed = os.getpid(), threading.Condition()  # (the parent's may be held)
            self._waiting, self._busy, self._thread = None, False, None

    def put(self, item: T, merge: Callable[[T, T], T] | None = None) -> bool:
        """Queue `item` in place of the one waiting (or `merge(waiting, item)`); False once closed."""
        self._in_this_process()
        with self._changed:
            if self._closed:
                return False
            if self._waiting is not None and merge is not None:
                item = merge(self._waiting, item)
            self._waiting = item
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
                self._thread.start()
            self._changed.notify_all()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        self._in_this_process()
        with self._changed:
            return self._changed.wait_for(lambda: self._waiting is None and not self._busy, timeout)

    def close(self, timeout: float | None = 0.0) -> None:
        """Take no more items; wait up to `timeout` for the one waiting to be done."""
        self._in_this_process()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return  # closed
                item, self._waiting, self._busy = self._waiting, None, True
            try:
                self._work(item)
            except Exception as exc:
                log.debug("%s: %s", self._thread_name, exc)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()


class PublishFuture(Future):
    superseded: bool = False  # a newer snapshot was sent in its place


@dataclass
class _Job:
    snapshot: Mapping[str, memoryview]
    options: dict
    futures: list[PublishFuture] = field(default_factory=list)


class BackgroundPublisher(LatestOnlyWorker[_Job]):
    """`send(snapshot, **options) -> version` per submit, a newer snapshot replacing one still waiting; sent
    buffers are reused (`spare_buffer`): no fresh page faults."""

    def __init__(self, send: Callable[..., int]) -> None:
        super().__init__(self._publish, "weightclient-publisher")
        self._send = send
        self._spares: list[memoryview] = []  # buffers of snapshots sent or replaced
        self._spares_lock = threading.Lock()

    def submit(self, snapshot: Mapping[str, memoryview], **options) -> PublishFuture:
        future = PublishFuture()
        if not self.put(_Job(snapshot, options, [future]), merge=self._coalesce):
            raise RuntimeError("the background publisher is closed")
        return future

    def spare_buffer(self) -> memoryview | None:
        with self._spares_lock:
            return self._spares.pop() if self._spares else None

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        super().close(timeout)

    def _coalesce(self, waiting: _Job, newer: _Job) -> _Job:
        log.debug("coalescing %d waiting publish(es) into the newest", len(waiting.futures))
        for older in waiting.futures:
            older.superseded = True
        self._recycle(waiting.snapshot)
        newer.futures[:0] = waiting.futures
        return newer

    def _publish(self, job: _Job) -> None:
        # From here cancel() is refused; a future its caller cancelled while it waited gets no result.
        futures = [future for future in job.futures if future.set_running_or_notify_cancel()]
        if not futures:  # every caller cancelled it: nothing is sent
            self._recycle(job.snapshot)
            return
        try:
            version, error = self._send(job.snapshot, **job.options), None
        except BaseException as exc:  # handed to the caller through the futures
            log.error("background publish failed: %s", exc)
            version, error = None, exc
        self._recycle(job.snapshot)  # first, so a caller woken by its future finds the buffer ready for reuse
        for future in futures:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(version)

    def _recycle(self, snapshot: Mapping[str, memoryview]) -> None:
        with self._spares_lock:
            self._spares.extend(snapshot.values())
            self._spares[:] = sorted(self._spares, key=lambda b: b.nbytes)[-4:]  # keep a few, largest
