"""The sha256 of a version committed with only an xxh3 declared, computed after its commit.

One background thread hashes such versions in turn, each once SHA256_DELAY_SECONDS have passed
unless a reader waits for it: the moments after a commit belong to the followers applying it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from weightserver.protocol import digests
from weightserver.protocol.errors import ServerUnavailable, VersionNotFound, WeightServerError
from weightserver.storage.index import ModelState, Version

SHA256_DELAY_SECONDS = 0.5


class Sha256Worker:
    """Hashes committed versions of `models` (guarded by `lock`) whose sha256 is ""."""

    def __init__(self, lock: threading.Lock, models: dict[str, ModelState]) -> None:
        self._lock, self._models = lock, models
        self._pending: dict[tuple[str, int], Future[str]] = {}
        self._hurry = threading.Event()  # a reader waits for a pending sha256: no delay
        self._executor: ThreadPoolExecutor | None = None  # started on first need
        self._closed = False

    def expect(self, record: Version) -> None:
        """Register `record` before any reader can see it. Caller holds the lock."""
        self._pending[(record.model, record.version)] = running_future()

    def hash_later(self, record: Version) -> None:
        """Queue `record`, registered with `expect`; by its key, so that it does not keep a
        version deleted meanwhile in memory."""
        key = (record.model, record.version)
        with self._lock:
            if not self._closed and self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightserver-sha256")
            executor = self._executor
        if executor is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                executor.submit(self._hash, key, record.created)
                return
        self._hash(key, record.created)  # closed: fails the future at once

    def sha256_of(self, record: Version, *, hurry: bool = True) -> Future[str]:
        """See `VersionStore.sha256_of`."""
        if record.sha256:
            return done_future(record.sha256)
        with self._lock:
            pending = self._pending.get((record.model, record.version))
            if pending is not None:
                if hurry:
                    self._hurry.set()
                return pending
            state = self._models.get(record.model)
            current = state.versions.get(record.version) if state is not None else None
        if current is not None and current.sha256:
            return done_future(current.sha256)
        failed = running_future()
        failed.set_exception(self._gone(record.model, record.version))
        return failed

    def close(self) -> None:
        """The hash running finishes; the versions still waiting fail with ServerUnavailable."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        self._hurry.set()
        if executor is not None:
            executor.shutdown(wait=True)

    def _hash(self, key: tuple[str, int], created: float) -> None:
        """Hash a retained version once its delay is out and put the sha256 in its record,
        under the commit lock, so that a pin meanwhile keeps both."""
        model, version = key
        state = self._models[model]
        self._hurry.wait(max(0.0, created + SHA256_DELAY_SECONDS - time.time()))
        with self._lock:
            future = self._pending[key]
            record = state.versions.get(version)
            if self._closed or record is None:
                del self._pending[key]
                future.set_exception(self._gone(model, version))
                return
        digest = digests.sha256_hex(record.data)
        with state.commit_lock, self._lock:
            current = state.versions.get(version)
            if current is not None:  # else deleted or evicted while it was being hashed
                state.versions[version] = dataclasses.replace(current, sha256=digest)
            del self._pending[key]
            if not self._pending:
                self._hurry.clear()  # none left that a reader waits for
        future.set_result(digest)

    def _gone(self, model: str, version: int) -> WeightServerError:
        if self._closed:
            return ServerUnavailable(f"model {model!r} v{version}: the server is stopping")
        return VersionNotFound(
            f"model {model!r}: version {version} was evicted or deleted before its sha256 was computed"
        )


def running_future() -> Future[str]:
    """A future nobody can cancel (it is running): several callers may wait on one sha256."""
    future: Future[str] = Future()
    future.set_running_or_notify_cancel()
    return future


def done_future(result: str) -> Future[str]:
    future = running_future()
    future.set_result(result)
    return future
