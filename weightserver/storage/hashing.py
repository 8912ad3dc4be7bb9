"""The sha256 of versions committed with only an xxh3, hashed by one thread SHA256_DELAY_SECONDS
after the commit (the moments after it belong to the followers applying it) or when a reader waits.
The same pass checks the xxh3s again: a same-host publisher's are committed as it declared them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from weightserver.protocol import digests, errors
from weightserver.storage.index import ModelState, Version

log = logging.getLogger(__name__)

SHA256_DELAY_SECONDS = 0.5
BACKGROUND_NICE = 19  # the pass's thread yields a shared core to the next publish's copy and the followers


def _in_background() -> None:
    """Lower the calling thread's priority (Linux: a thread's own nice value); where refused, leave it."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def after_commit(record: Version) -> dict[str, Any]:
    """The fields the pass after the commit sets: the sha256, and where a publisher's declared xxh3s
    (`record.declared`) differ from the bytes', an error logged and the bytes' own."""
    if not record.declared:
        return {"sha256": digests.sha256_hex(record.data)}
    found = digests.rehashed(record.data, record.header)
    fields = {"sha256": found.sha256 or "", "declared": False}
    wrong = sorted(name for name, digest in found.tensor_xxh3.items() if record.tensor_xxh3.get(name) != digest)
    if found.xxh3 == record.xxh3 and not wrong:
        return fields
    log.error(
        "model %r v%d: its publisher declared digests that do not match its bytes (file xxh3: %s, tensors: %s); "
        "the bytes' own replace them. Its publisher wrote the bytes after hashing them, or has a bug",
        *(record.model, record.version, "wrong" if found.xxh3 != record.xxh3 else "right", wrong[:5] or "right"),
    )
    return {**fields, "xxh3": found.xxh3, "tensor_xxh3": found.tensor_xxh3}


class Sha256Worker:
    def __init__(self, lock: threading.Lock, models: dict[str, ModelState]) -> None:
        self._lock, self._models = lock, models
        self._pending: dict[tuple[str, int], Future[str]] = {}
        self._hurry = threading.Event()  # a reader waits for a pending sha256: no delay
        self._executor = ThreadPoolExecutor(1, "weightserver-sha256", _in_background)  # no thread until used
        self._closed = False

    def expect(self, record: Version) -> None:
        """Register `record` before any reader can see it. Caller holds the lock."""
        self._pending[(record.model, record.version)] = future = Future()
        future.set_running_or_notify_cancel()  # nobody can cancel it: several callers may wait on it

    def hash_later(self, record: Version) -> None:
        """Queue `record` (registered with `expect`) by key, so that a deleted one can be freed."""
        try:
            self._executor.submit(self._hash, (record.model, record.version), record.created)
        except RuntimeError:  # closed: fails the future at once
            self._hash((record.model, record.version), record.created)

    def sha256_of(self, record: Version, *, hurry: bool = True) -> Future[str]:
        """`record`'s sha256, once hashed (`hurry`: now, else after a delay); VersionNotFound if it went first."""
        with self._lock:
            pending = self._pending.get((record.model, record.version))
            if pending is not None and not record.sha256:
                if hurry:
                    self._hurry.set()
                return pending
            state = self._models.get(record.model)
            current = state.versions.get(record.version) if state is not None else None
        future, sha256 = Future[str](), record.sha256 or (current.sha256 if current is not None else "")
        if sha256:
            future.set_result(sha256)
        else:
            future.set_exception(self._gone(record.model, record.version))
        return future

    def close(self) -> None:
        """The hash running finishes; those waiting fail with ServerUnavailable."""
        with self._lock:
            self._closed = True
        self._hurry.set()
        self._executor.shutdown(wait=True)

    def _hash(self, key: tuple[str, int], created: float) -> None:
        """Hash a retained version once its delay is out; replaced under the commit lock, so a pin keeps both."""
        model, version = key
        state = self._models[model]
        self._hurry.wait(max(0.0, created + SHA256_DELAY_SECONDS - time.time()))
        with self._lock:
            record = state.versions.get(version)
            if self._closed or record is None:
                self._pending.pop(key).set_exception(self._gone(model, version))
                return
        fields = after_commit(record)
        with state.commit_lock, self._lock:
            current = state.versions.get(version)
            if current is not None:  # else deleted or evicted while it was being hashed
                state.versions[version] = dataclasses.replace(current, **fields)
            future = self._pending.pop(key)
            if not self._pending:
                self._hurry.clear()  # none left that a reader waits for
        future.set_result(fields["sha256"])

    def _gone(self, model: str, version: int) -> errors.WeightServerError:
        if self._closed:
            return errors.ServerUnavailable(f"model {model!r} v{version}: the server is stopping")
        return errors.VersionNotFound(
            f"model {model!r}: version {version} was evicted or deleted before its sha256 was computed"
        )
