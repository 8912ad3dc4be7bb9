"""VersionStore: the versions of every model, their retention and their persistence. Thread-safe;
a version becomes visible once its bytes passed every check and, with a data directory, are durable."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightserver.protocol.errors import InvalidRequest
from weightserver.protocol.names import validate_model_name, validate_publish_id
from weightserver.storage.commit import Checks, Commit, PublishIds, Upload, check_version
from weightserver.storage.hashing import Sha256Worker
from weightserver.storage.index import MAX_VERSION, ModelInfo, Version, VersionIndex
from weightserver.storage.persistence import Disk

__all__ = ["MAX_VERSION", "Commit", "ModelInfo", "Upload", "Version", "VersionStore"]

log = logging.getLogger(__name__)
RELEASE_DELAY_SECONDS = 0.25  # an evicted version's memory is let go this long after the commit (see `commit`)


class VersionStore(VersionIndex):
    """Versions of named models with retention (`keep` latest + pinned) and optional persistence.

    >>> from weightserver.protocol.safetensors_format import build_header
    >>> VersionStore().publish("policy", build_header([("w", "U8", (2,), 2)])[0] + b"\\x01\\x02").version
    1
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep: int = 3,
        max_model_bytes: int | None = None,
        describe: Callable[[Version], int] | None = None,
        **header_limits: int | None,
    ) -> None:
        """`header_limits`: parse_header's; `describe(version)`: its description's size, to refuse one too big."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        super().__init__()
        self.keep = keep
        self.header_limits = {k: v for k, v in header_limits.items() if v is not None}  # also for Upload.digests
        self._checks = Checks(max_model_bytes, self.header_limits, describe)
        self._publish_ids = PublishIds(self._models)
        self._sha256 = Sha256Worker(self._lock, self._models)
        self.sha256_of = self._sha256.sha256_of  # `record`'s sha256 as a Future, once hashed
        self._releasing = ThreadPoolExecutor(1, thread_name_prefix="weightserver-release")  # no thread until used
        self._listeners: list[Callable[[Commit], None]] = []
        self._disk = Disk(Path(data_dir), describe) if data_dir is not None else None
        if self._disk is not None:
            self._models.update(self._disk.load())
            for state in self._models.values():
                self._remove_files(state.evict(keep))
            self._publish_ids.rebuild()

    def close(self) -> None:
        self._sha256.close()

    def check_publish(
        self, model: str, *, total_bytes: int, version: int = 0, metadata: Mapping | None = None, publish_id: str = ""
    ) -> None:
        """The checks before any byte is received."""
        validate_model_name(model)
        self._checks.size(model, total_bytes)
        self._checks.metadata(model, metadata or {})
        with self._lock:
            state = self._models.get(model)
            if self._publish_ids.check([model], validate_publish_id(publish_id)) is None:
                check_version([model], version, state.high_water if state else 0)

    def publish(
        self, model: str, data: bytes | bytearray | memoryview, *, version: int = 0, publish_id: str = "", **upload: Any
    ) -> Version:
        """Commit `data` as a new version of `model`; `upload`: the other Upload fields."""
        return self.publish_group([Upload(model, data, **upload)], version=version, publish_id=publish_id)[0]

    def publish_group(self, uploads: Sequence[Upload], *, version: int = 0, publish_id: str = "") -> list[Version]:
        """Commit `uploads` (see `commit`); their versions, in `uploads` order."""
        with self.commit(uploads, version=version, publish_id=publish_id) as event:
            pass
        return list(event.versions)

    @contextlib.contextmanager
    def commit(
        self, uploads: Sequence[Upload], *, version: int = 0, publish_id: str = "", created: float | None = None
    ) -> Iterator[Commit]:
        """Verify several models' bytes and commit them under ONE version number (0: the next). The
        `with` body gets the Commit once durable, under the commit locks, before anyone can see it (an
        exception there is logged). A repeated `publish_id` commits nothing: its Commit is `replayed`."""
        if not uploads:
            raise InvalidRequest("a publish needs at least one model")
        if version < 0:
            raise InvalidRequest(f"version must be >= 0, got {version}")
        validate_publish_id(publish_id)
        names = [validate_model_name(u.model) for u in uploads]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"a publish names a model twice: {', '.join(names)}")
        group = tuple(names) if len(names) > 1 else ()
        verified = [self._checks.verify(u, group) for u in uploads]  # hashed before taking any lock
        self._checks.reply(verified)
        states = {name: self._model_state(name) for name in names}
        with contextlib.ExitStack() as locks:
            for name in sorted(names):  # one fixed order, so two groups cannot deadlock
                locks.enter_context(states[name].commit_lock)
            with self._lock:
                repeated = self._publish_ids.check(names, publish_id, verified)
                if repeated is None:
                    high_water = max(state.high_water for state in states.values())
                    check_version(names, version, high_water)
                    for record in verified:
                        self._checks.listing(states[record.model], record, self.keep)
                    if publish_id:
                        self._publish_ids.committing[publish_id] = tuple(names)
            if repeated is not None:
                log.info("publish id %r repeats %s v%d: nothing committed", publish_id, names, repeated[0].version)
                yield Commit(tuple(repeated), publish_id, replayed=True, visible=True)
                return
            try:
                number, now = version or high_water + 1, time.time() if created is None else created
                records = [dataclasses.replace(r, version=number, created=now, publish_id=publish_id) for r in verified]
                if self._disk is not None:
                    records = self._disk.write_group(records)
                event = Commit(tuple(records), publish_id)
                try:
                    yield event
                except Exception:
                    log.exception("the commit hook failed on %s v%d", ", ".join(names), number)
                evicted: list[Version] = []
                with self._lock:  # visible: the whole group at once
                    for record in records:
                        state = states[record.model]
                        state.versions[record.version], state.high_water = record, record.version
                        evicted += state.evict(self.keep)
                        if not record.sha256:  # registered before any reader can see the record
                            self._sha256.expect(record)
                        if record.publish_id:
                            self._publish_ids.add(record)
                    listeners = list(self._listeners)
                event = dataclasses.replace(event, evicted=tuple(evicted), visible=True)
                for listener in listeners:
                    try:
                        listener(event)
                    except Exception:
                        log.exception("%r failed on %s v%d", listener, ", ".join(names), number)
            finally:
                with self._lock:
                    self._publish_ids.committing.pop(publish_id, None)
        for record in event.versions:
            if not record.sha256:
                self._sha256.hash_later(record)
        self._remove_files(list(event.evicted))
        # `evicted` holds the last references to the evicted versions: it is cleared in a thread of its own
        # (freeing 256 MiB took 40-50 ms) and later, as the reply and the collectors' applies come first.
        del event
        self._releasing.submit(_release, time.monotonic() + RELEASE_DELAY_SECONDS, evicted)

    def subscribe(self, listener: Callable[[Commit], None]) -> Callable[[], None]:
        """Call `listener(commit)` once each commit is visible, in order, under its commit locks (must not block)."""
        return subscribed(self._lock, self._listeners, listener)

    def delete(self, model: str, version: int, *, evicted: bool = False) -> Version:
        """Delete one version, from disk first. `evicted`: by its upstream (a relay): VersionEvicted later."""
        self.get(model, version)  # raises the right NotFound before taking the commit lock
        state = self._model_state(model)
        with state.commit_lock:  # no commit, eviction or pin of this model meanwhile
            record = self.get(model, version)
            if self._disk is not None:
                self._disk.delete_files(record, state.high_water)
            with self._lock:
                del state.versions[version]
                state.removed.add(version)
                if not evicted:
                    state.deleted.add(version)
        return record

    def set_pinned(self, model: str, version: int, pinned: bool) -> Version:
        """Pin (keep beyond `keep`) or unpin a version; unpinning may evict it."""
        self.get(model, version)  # raises the right NotFound before taking the commit lock
        state = self._model_state(model)
        with state.commit_lock:
            updated = dataclasses.replace(self.get(model, version), pinned=pinned)
            if self._disk is not None:
                with self._disk.writes():
                    self._disk.write_manifest(updated)
            with self._lock:  # the commit lock keeps it retained meanwhile
                state.versions[version] = updated
                evicted = state.evict(self.keep)
        self._remove_files(evicted)
        return updated

    def _remove_files(self, records: list[Version]) -> None:  # after the commit locks are released
        if self._disk is not None:
            self._disk.remove_files(records)


def _release(due: float, evicted: list[Version]) -> None:
    time.sleep(max(0.0, due - time.monotonic()))
    evicted.clear()


def subscribed(lock: threading.Lock, listeners: list[Callable[[Any], None]], listener: Callable) -> Callable[[], None]:
    """Add `listener` to `listeners` under `lock`; the function that removes it."""
    with lock:
        listeners.append(listener)

    def unsubscribe() -> None:
        with lock, contextlib.suppress(ValueError):
            listeners.remove(listener)

    return unsubscribe
