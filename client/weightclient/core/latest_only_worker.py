"""LatestOnlyWorker: one daemon thread working through items one at a time, where only the
newest item waiting matters (background publishes, reports of direct reads)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LatestOnlyWorker(Generic[T]):
    """Runs `work(item)` for the items `put`, one at a time, in a thread started on the first
    put (again in a forked child). An exception from `work` is logged at debug level."""

    def __init__(self, work: Callable[[T], object], thread_name: str) -> None:
        self._work = work
        self._thread_name = thread_name
        self._changed = threading.Condition()
        self._waiting: T | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, item: T, merge: Callable[[T, T], T] | None = None) -> bool:
        """Queue `item` in place of the one waiting (or `merge(waiting, item)`); False once closed."""
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
        with self._changed:
            return self._changed.wait_for(lambda: self._waiting is None and not self._busy, timeout)

    def close(self, timeout: float | None = 0.0) -> None:
        """Take no more items; wait up to `timeout` for the one waiting to be done."""
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
