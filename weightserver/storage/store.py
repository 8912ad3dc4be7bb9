"""VersionStore: the versions of every model, their retention and their persistence.

Plain Python with no gRPC import, thread-safe, testable alone. A version becomes visible only
after its bytes passed every check (size, the digests the publisher declared, safetensors
header) and, with a data directory, after its file and manifest were written to a temp file,
fsynced and renamed into place. Readers therefore only ever see complete, verified versions.

Digests: xxh3-128 of the file and of each tensor, and sha256. An upload brings them when they
were computed while its bytes arrived (`Upload.digests`), else they are computed here. A
version whose publisher declared only an xxh3 is committed in memory with sha256 "" and hashed
afterwards by one background worker (`sha256_of` waits for it), which first lets
SHA256_DELAY_SECONDS pass unless a reader asks for the digest (`sha256_of(hurry=True)`): the
moments after a commit belong to the followers applying the version. With a data directory the
sha256 is instead computed while the data file is written and fsynced, so that every manifest
carries it.

On-disk layout under ``data_dir``::

    <model>/<version:012d>.safetensors   the published bytes, unchanged
    <model>/<version:012d>.json          manifest: sha256, size, created, metadata, pinned
    <model>/high_water.json              highest version ever committed (written on delete)

The manifest is written after the data file, so its presence marks a committed version; a
data file without a manifest is debris from a crash and is removed on start. A delete removes
the data file first (so it works on a full disk), then records the high-water mark, then
removes the manifest: a manifest without its data file is never loaded, and keeps its number
from being handed out again until the high-water mark holds it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from weightserver.protocol.digests import FileDigests
from weightserver.protocol.errors import (
    CursorOutOfRange,
    DescriptionTooLarge,
    IntegrityError,
    InvalidModelName,
    InvalidRequest,
    ModelNotFound,
    ModelTooLarge,
    ServerUnavailable,
    StorageFull,
    VersionConflict,
    VersionEvicted,
    VersionNotFound,
    VersionTooLarge,
    WeightServerError,
    clipped_repr,
)
from weightserver.protocol.limits import MAX_DESCRIPTION_BYTES, MAX_DESCRIPTIONS_PER_REPLY
from weightserver.protocol.safetensors_format import SafetensorsHeader, parse_header
from weightserver.storage.payloads import tensor_digests, xxh3_hex

log = logging.getLogger(__name__)

_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_PUBLISH_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces
_DATA_SUFFIX = ".safetensors"
_MANIFEST_SUFFIX = ".json"
_HIGH_WATER = "high_water.json"
# The largest version number: every version fits a signed 64-bit integer (clients in other
# languages, JSON) and the next one still fits the proto's uint64.
MAX_VERSION = 2**63 - 1
# A version's sha256, computed after its commit, waits this long unless a reader asks for it.
SHA256_DELAY_SECONDS = 0.5


def validate_model_name(model: str) -> str:
    """`model` if it is a safe model name, else InvalidModelName: names become directory names
    under --data-dir, so the rules (in the error message) keep them inside it."""
    if not isinstance(model, str) or not _MODEL_NAME.fullmatch(model) or ".." in model:
        raise InvalidModelName(
            f"invalid model name {clipped_repr(model)}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "not starting with '.' or '-' and without '..'"
        )
    return model


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Version:
    """One committed, verified version. Immutable; pinning, and a sha256 computed after the
    commit, replace the record."""

    model: str
    version: int
    data: bytes | bytearray | memoryview = field(repr=False)
    sha256: str  # "" until the background worker has hashed it (see the module docstring)
    created: float
    metadata: Mapping[str, str]
    header: SafetensorsHeader = field(repr=False)
    pinned: bool = False
    group: tuple[str, ...] = ()  # models committed together under this version number
    xxh3: str = ""  # xxh3-128 of the whole file
    tensor_xxh3: Mapping[str, str] = field(default_factory=dict, repr=False)  # per tensor, by name
    description_bytes: int = 0  # its description as clients receive it, at most (0: not measured)
    publish_id: str = ""  # the idempotency key of the publish that committed it ("": none)

    @property
    def byte_size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Upload:
    """One model's bytes in a publish, with what the publisher declared about them.

    `sha256`, `xxh3`: the digests the publisher declared (None: not declared); each one given
    is checked. `digests`: what the receiver computed while the bytes arrived (the header
    parsed with this store's `header_limits`), so that nothing is hashed twice; None: the
    store computes them, sha256 included unless only an xxh3 was declared.

    `on_commit`, when given, is called with the Version these bytes became once it is durable
    and before any reader can see it (no get, no fetch, no listener yet), under the model's
    commit lock: the caller's chance to put things in place beside the version. It must not
    block for long; an exception is logged and the commit stands.
    """

    model: str
    data: bytes | bytearray | memoryview = field(repr=False)
    sha256: str | None = None
    total_bytes: int | None = None
    metadata: Mapping[str, str] | None = None
    pin: bool = False
    on_commit: Callable[[Version], None] | None = field(default=None, repr=False)
    digests: FileDigests | None = field(default=None, repr=False)
    xxh3: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """A model at a glance."""

    model: str
    latest_version: int
    version_count: int
    retained_bytes: int


@dataclass
class _Model:
    versions: dict[int, Version] = field(default_factory=dict)  # insertion order == version order
    high_water: int = 0  # highest version ever committed, retained or not
    removed: list[int] = field(default_factory=list)  # sorted; evicted or deleted (this process)
    deleted: set[int] = field(default_factory=set)  # deleted on request (this process)
    # A relay's: versions of its upstream it will never hold, each the number missed or, for
    # versions whose numbers the upstream did not say, the highest such number (this process).
    missed: list[int] = field(default_factory=list)  # sorted
    commit_lock: threading.Lock = field(default_factory=threading.Lock)


class VersionStore:
    """Versions of named models with retention (`keep` latest + pinned) and optional persistence.

    >>> store = VersionStore()
    >>> from weightserver.protocol.safetensors_format import build_header
    >>> prefix, _ = build_header([("w", "U8", (2,), 2)])
    >>> v = store.publish("policy", prefix + b"\\x01\\x02")
    >>> (v.version, store.latest("policy").sha256 == v.sha256)
    (1, True)
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep: int = 3,
        max_model_bytes: int | None = None,
        max_header_bytes: int | None = None,
        max_tensors: int | None = None,
        describe: Callable[[Version], int] | None = None,
    ) -> None:
        """`describe(version)`: the bytes of a version's description as clients receive it
        (the server passes `wire.description_bytes`). With it, a publish is refused before it
        commits if a description would be over MAX_DESCRIPTION_BYTES, or the descriptions a
        Publish or ListVersions reply carries would add up to more than a client receives."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.keep = keep
        self.max_model_bytes = max_model_bytes
        self._describe = describe
        self._header_limits: dict[str, int] = {}
        if max_header_bytes is not None:
            self._header_limits["max_header_bytes"] = max_header_bytes
        if max_tensors is not None:
            self._header_limits["max_tensors"] = max_tensors
        self._lock = threading.Lock()
        self._models: dict[str, _Model] = {}
        # Publish ids -> the (model, version)s committed with them. Entries may be gone since
        # (evicted, deleted): `_carriers` checks each, and the index is rebuilt from the
        # retained versions once it has doubled, so it holds no more than that.
        self._publish_ids: dict[str, list[tuple[str, int]]] = {}
        self._publish_ids_rebuilt = 0  # its size when last rebuilt
        # Publish ids of publishes committing now -> their models.
        self._committing_ids: dict[str, tuple[str, ...]] = {}
        self._listeners: list[Callable[[Version], None]] = []
        # Versions committed with sha256 "", until the worker (started on first need) hashed them.
        self._pending_sha256: dict[tuple[str, int], Future[str]] = {}
        self._sha256_hurry = threading.Event()  # a reader waits for a pending sha256: no delay
        self._sha256_worker: ThreadPoolExecutor | None = None
        self._closed = False
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._load()

    @property
    def header_limits(self) -> dict[str, int]:
        """parse_header's keyword limits this store applies (for `Upload.digests` computed elsewhere)."""
        return dict(self._header_limits)

    def close(self) -> None:
        """Let the background sha256 worker go. The hash it is computing finishes; versions still
        waiting keep sha256 "" and their `sha256_of` futures fail with ServerUnavailable."""
        with self._lock:
            self._closed = True
            worker, self._sha256_worker = self._sha256_worker, None
        self._sha256_hurry.set()  # no job waits out its delay now
        if worker is not None:
            worker.shutdown(wait=True)

    # ------------------------------------------------------------------ publishing
    def check_publish(
        self,
        model: str,
        *,
        total_bytes: int,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        publish_id: str = "",
    ) -> None:
        """Cheap checks before any byte is received: name, size limit, metadata size, version
        order (not for a repeat of a publish id: its version is the one already committed)."""
        validate_model_name(model)
        self._check_size(model, total_bytes)
        metadata_bytes = _metadata_bytes(metadata or {})
        if self._describe is not None and metadata_bytes > MAX_DESCRIPTION_BYTES:
            raise DescriptionTooLarge(
                f"model {model!r}: {metadata_bytes} bytes of metadata are over the limit of {MAX_DESCRIPTION_BYTES} "
                "bytes (1 MiB) on a version's description (tensor list and metadata), which keeps it within "
                "what a gRPC client receives by default; publish less metadata"
            )
        with self._lock:
            state = self._models.get(model)
            if state is not None and _committed_by(state, _checked_publish_id(publish_id)):
                return
            self._check_id_unused_elsewhere([model], publish_id, partial=True)
            _check_version([model], version, state.high_water if state else 0)

    def publish(
        self,
        model: str,
        data: bytes | bytearray | memoryview,
        *,
        sha256: str | None = None,
        total_bytes: int | None = None,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        publish_id: str = "",
        xxh3: str | None = None,
    ) -> Version:
        """Verify `data` and commit it as a new version of `model`; return the version.

        `sha256`, `xxh3` and `total_bytes`, when given, are what the publisher declared; a
        mismatch raises IntegrityError. With only `xxh3` declared, the version's sha256 is
        computed after the commit (see `sha256_of`). `version` 0 assigns latest + 1; otherwise
        it must exceed every version the model ever had (VersionConflict). Nothing is visible
        until this returns. `publish_id`: see `publish_group`.
        """
        upload = Upload(model, data, sha256=sha256, total_bytes=total_bytes, metadata=metadata, pin=pin, xxh3=xxh3)
        return self.publish_group([upload], version=version, publish_id=publish_id)[0]

    def publish_group(
        self, uploads: Sequence[Upload], *, version: int = 0, publish_id: str = "", created: float | None = None
    ) -> list[Version]:
        """Verify several models' bytes and commit them under ONE version number, together.

        The number is `version` (at most MAX_VERSION), or one above the highest version any of
        the models ever had.
        Readers see all of the group's versions or none of them; after a crash mid-commit the
        partial group is dropped on restart. Returns the versions in `uploads` order.

        `publish_id`, an idempotency key: if retained versions were committed by a publish with
        this id, they are returned and nothing is committed (no `on_commit`, no listener). The
        check runs under the commit locks, so a repeat that arrives while the first publish is
        still committing waits for it and returns its versions. An id names one publish in the
        whole store: while a retained version of another model carries it, or a publish of
        other models with it is committing, InvalidRequest.

        `created`: the commit time to record (Unix seconds), for a relay that keeps its
        upstream's; default now.
        """
        if not uploads:
            raise InvalidRequest("a publish needs at least one model")
        if version < 0:
            raise InvalidRequest(f"version must be >= 0, got {version}")
        _checked_publish_id(publish_id)
        names = [validate_model_name(u.model) for u in uploads]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"a publish names a model twice: {', '.join(names)}")
        group = tuple(names) if len(names) > 1 else ()
        verified = [self._verify(u, group) for u in uploads]  # hashed before taking any lock
        # The reply lists every model's description, and the first one once more.
        reply_bytes = verified[0].description_bytes + sum(v.description_bytes for v in verified)
        if reply_bytes > MAX_DESCRIPTIONS_PER_REPLY:
            raise DescriptionTooLarge(
                f"model {_names(names)}: the descriptions of this publish add up to {reply_bytes} bytes, over the "
                f"{MAX_DESCRIPTIONS_PER_REPLY} bytes its reply may carry to a gRPC client with default settings; "
                "publish fewer models at once"
            )

        states = {name: self._model_state(name) for name in names}
        with contextlib.ExitStack() as locks:
            for name in sorted(names):  # one fixed order, so two groups cannot deadlock
                locks.enter_context(states[name].commit_lock)
            with self._lock:
                repeated = _repeated(names, states, verified, publish_id)
                if repeated is not None:
                    log.info("publish id %r repeats %s v%d: nothing committed", publish_id, names, repeated[0].version)
                    return repeated
                self._check_id_unused_elsewhere(names, publish_id)
                high_water = max(state.high_water for state in states.values())
                _check_version(names, version, high_water)
                number = version or high_water + 1
                for record in verified:
                    self._check_listing(states[record.model], record)
                if publish_id:
                    self._committing_ids[publish_id] = tuple(names)
            try:
                records, evicted = self._commit(uploads, verified, states, number, publish_id, created)
            finally:
                if publish_id:
                    with self._lock:
                        self._committing_ids.pop(publish_id, None)
        for record in records:
            if not record.sha256:
                self._hash_later(record)
        self._remove_files(evicted)
        return records

    def _commit(
        self,
        uploads: Sequence[Upload],
        verified: Sequence[Version],
        states: Mapping[str, _Model],
        number: int,
        publish_id: str,
        created: float | None,
    ) -> tuple[list[Version], list[Version]]:
        """Number, write and make visible a checked group (the caller holds its commit locks):
        its versions, and those the commit evicted."""
        created = time.time() if created is None else created
        records = [
            dataclasses.replace(record, version=number, created=created, publish_id=publish_id) for record in verified
        ]
        if self.data_dir is not None:
            records = self._write_group(records)
        for upload, record in zip(uploads, records, strict=True):
            if upload.on_commit is not None:
                _call_logged(upload.on_commit, record)
        evicted: list[Version] = []
        with self._lock:
            for record in records:
                state = states[record.model]
                state.versions[number] = record
                state.high_water = number
                evicted += self._evict(state)
                if not record.sha256:  # registered before any reader can see the record
                    self._pending_sha256[(record.model, number)] = _running_future()
                if publish_id:
                    self._index_publish_id(record)
            listeners = list(self._listeners)
        # Still under the commit locks, so listeners see each model's versions in order.
        for record in records:
            for listener in listeners:
                _call_logged(listener, record)
        return records, evicted

    def _check_id_unused_elsewhere(self, names: Sequence[str], publish_id: str, *, partial: bool = False) -> None:
        """InvalidRequest when a retained version of a model outside `names` carries
        `publish_id`, or a publish of other models with it is committing now: an id names one
        publish. `partial`: `names` may be part of a group publish (one header's check), so a
        version of a group that includes them is no reason to refuse (the commit checks the
        whole group). Caller holds the lock."""
        if not publish_id:
            return
        committing = self._committing_ids.get(publish_id)
        if committing is not None and not set(committing) & set(names):
            raise InvalidRequest(
                f"publish id {publish_id!r} belongs to a publish of {_names(committing)} committing now; a publish id "
                "names one publish: a retry sends the same models and bytes, a new publish needs a new id"
            )
        for record in self._carriers(publish_id):
            models = record.group or (record.model,)
            if record.model in names or (partial and set(names) <= set(models)):
                continue
            raise InvalidRequest(
                f"publish id {publish_id!r} was already used by version {record.version} of {_names(models)}; a "
                "publish id names one publish: a retry sends the same models and bytes, a new publish needs a new id"
            )

    def _carriers(self, publish_id: str) -> list[Version]:
        """The retained versions committed with `publish_id`. Caller holds the lock."""
        found = []
        for model, number in self._publish_ids.get(publish_id, ()):
            state = self._models.get(model)
            record = state.versions.get(number) if state is not None else None
            if record is not None and record.publish_id == publish_id:
                found.append(record)
        return found

    def _index_publish_id(self, record: Version) -> None:
        """Remember that `record` carries its publish id; rebuild the index from the retained
        versions once it has doubled since the last rebuild. Caller holds the lock."""
        self._publish_ids.setdefault(record.publish_id, []).append((record.model, record.version))
        if len(self._publish_ids) > 2 * self._publish_ids_rebuilt + 1024:
            self._rebuild_publish_ids()

    def _rebuild_publish_ids(self) -> None:
        """The index of publish ids from the retained versions alone. Caller holds the lock (or
        is loading)."""
        self._publish_ids = {}
        for state in self._models.values():
            for record in state.versions.values():
                if record.publish_id:
                    self._publish_ids.setdefault(record.publish_id, []).append((record.model, record.version))
        self._publish_ids_rebuilt = len(self._publish_ids)

    def _verify(self, upload: Upload, group: tuple[str, ...]) -> Version:
        """Size, digest and header checks of one upload; returns its Version, not yet numbered."""
        model, size = upload.model, len(upload.data)
        if upload.total_bytes is not None and upload.total_bytes != size:
            raise IntegrityError(
                f"model {model!r}: publisher declared {upload.total_bytes} bytes but sent {size}; "
                "the upload was cut short or the header is wrong"
            )
        self._check_size(model, size)
        # Without `digests` (a direct caller) they are computed here, the declared digests
        # checked before the header is parsed. The sha256 is left to the background worker
        # only when the publisher declared just an xxh3.
        digests, data = upload.digests, upload.data
        xxh3 = digests.xxh3 if digests is not None else xxh3_hex(data)
        if upload.xxh3 is not None and upload.xxh3.lower() != xxh3:
            raise IntegrityError(
                f"model {model!r}: xxh3 of the received bytes is {xxh3}, publisher declared "
                f"{upload.xxh3.lower()}; the bytes were corrupted in transit or the digest is wrong"
            )
        sha256 = digests.sha256 if digests is not None else None
        if sha256 is None and (upload.sha256 is not None or upload.xxh3 is None):
            sha256 = sha256_hex(data)
        if upload.sha256 is not None and upload.sha256.lower() != sha256:
            raise IntegrityError(
                f"model {model!r}: sha256 of the received bytes is {sha256}, publisher declared "
                f"{upload.sha256.lower()}; the bytes were corrupted in transit or the digest is wrong"
            )
        header = digests.header if digests is not None else parse_header(data, **self._header_limits)
        record = Version(
            model=model,
            version=0,
            data=data,
            sha256=sha256 or "",
            created=0.0,
            metadata=dict(upload.metadata or {}),
            header=header,
            pinned=upload.pin,
            group=group,
            xxh3=xxh3,
            tensor_xxh3=digests.tensor_xxh3 if digests is not None else tensor_digests(data, header),
        )
        if self._describe is None:
            return record
        # Measured as it will be at its largest: the largest number, pinned, its sha256 known.
        largest = dataclasses.replace(record, version=MAX_VERSION, created=time.time(), pinned=True, sha256="0" * 64)
        size = self._describe(largest)
        if size > MAX_DESCRIPTION_BYTES:
            raise DescriptionTooLarge(
                f"model {model!r}: the version's description (names, shapes and digests of {len(header.tensors)} "
                f"tensors, and {_metadata_bytes(record.metadata)} bytes of metadata) would be {size} bytes, over the "
                f"limit of {MAX_DESCRIPTION_BYTES} bytes (1 MiB) that keeps it within what a gRPC client receives "
                "by default; publish fewer tensors (split the model into several, published together as a group) "
                "or less metadata"
            )
        return dataclasses.replace(record, description_bytes=size)

    def _check_listing(self, state: _Model, record: Version) -> None:
        """The retained versions' descriptions, `record` included, must fit one ListVersions
        reply. Publishing is the only way to retain more, so checking it here is enough.
        Caller holds the lock."""
        versions = [*state.versions.values(), record]
        unpinned = [v for v in versions if not v.pinned]
        total = sum(v.description_bytes for v in versions if v.pinned) + sum(
            v.description_bytes for v in unpinned[-self.keep :]
        )
        if total > MAX_DESCRIPTIONS_PER_REPLY:
            raise DescriptionTooLarge(
                f"model {record.model!r}: with this version the descriptions of its retained versions would add "
                f"up to {total} bytes, over the {MAX_DESCRIPTIONS_PER_REPLY} bytes one ListVersions reply may "
                "carry to a gRPC client with default settings; unpin or delete versions, or lower --keep"
            )

    def _check_size(self, model: str, size: int) -> None:
        if self.max_model_bytes is not None and size > self.max_model_bytes:
            raise ModelTooLarge(
                f"model {model!r}: {size} bytes is over the server's limit of {self.max_model_bytes} "
                "bytes (--max-model-bytes)"
            )

    def _model_state(self, model: str) -> _Model:
        with self._lock:
            return self._models.setdefault(model, _Model())

    def _evict(self, state: _Model) -> list[Version]:
        """Drop unpinned versions beyond the `keep` newest. Caller holds the lock."""
        unpinned = [v for v in state.versions.values() if not v.pinned]
        doomed = unpinned[: max(0, len(unpinned) - self.keep)]
        for record in doomed:
            del state.versions[record.version]
            bisect.insort(state.removed, record.version)
        return doomed

    # ------------------------------------------------------------------ reading
    def latest(self, model: str) -> Version:
        """The newest version of `model`; ModelNotFound if it has none."""
        with self._lock:
            return next(reversed(self._retained(model).versions.values()))

    def get(self, model: str, version: int) -> Version:
        """Exactly `version` of `model`; VersionEvicted / VersionNotFound / ModelNotFound."""
        with self._lock:
            state = self._retained(model)
            record = state.versions.get(version)
            if record is not None:
                return record
            retained = list(state.versions)
            if version in state.deleted:
                raise VersionNotFound(
                    f"model {model!r}: version {version} was deleted; retained versions: {_ranges(retained)}"
                )
            if 0 < version < retained[-1] and (version < retained[0] or _contains(state.removed, version)):
                raise VersionEvicted(
                    f"model {model!r}: version {version} is no longer retained; the oldest retained "
                    f"is {retained[0]} (retained: {_ranges(retained)}); pin versions you need to keep"
                )
            raise VersionNotFound(f"model {model!r} has no version {version}; retained versions: {_ranges(retained)}")

    def newer_than(self, model: str, version: int) -> Version | None:
        """The latest version if it is newer than `version`, else None (caller is up to date)."""
        latest = self.latest(model)
        if version > latest.version:
            raise CursorOutOfRange(
                f"model {model!r}: version {version} is ahead of the latest version {latest.version}; "
                "the server may have restarted without --data-dir, or the version came from another server"
            )
        return latest if latest.version > version else None

    def versions(self, model: str) -> list[Version]:
        """Retained versions of `model`, oldest first."""
        with self._lock:
            return list(self._retained(model).versions.values())

    def versions_after(self, model: str, since: int) -> tuple[list[Version], bool]:
        """Retained versions newer than `since`, oldest first, and whether any version after
        `since` was evicted, deleted or missed (`missed`) before it could be returned (a gap).

        A model with no versions yet returns ``([], False)`` for ``since=0``: watchers wait for
        the first one. A `since` above every version ever committed raises CursorOutOfRange.
        """
        validate_model_name(model)
        with self._lock:
            state = self._models.get(model)
            high_water = state.high_water if state else 0
            if since > high_water:
                raise CursorOutOfRange(
                    f"model {model!r}: since={since} is ahead of the latest version {high_water}; "
                    "the server may have restarted without --data-dir; resubscribe with since=0"
                )
            if state is None:
                return [], False
            newer = [v for v in state.versions.values() if v.version > since]
            # Every removed or missed version after `since` is missing from `newer`, also one
            # behind a pinned version that is returned.
            gap = any(bisect.bisect_right(numbers, since) < len(numbers) for numbers in (state.removed, state.missed))
            return newer, gap

    def gap_between(self, model: str, after: int, before: int) -> bool:
        """Whether a version numbered between `after` and `before` (both excluded) was evicted,
        deleted or missed: a watcher that saw `after` and then sees `before` missed it. On a
        primary every commit is an event, so only a relay's missed versions make this true
        for two consecutive events."""
        with self._lock:
            state = self._models.get(model)
            if state is None:
                return False
            return any(
                bisect.bisect_right(numbers, after) < bisect.bisect_left(numbers, before)
                for numbers in (state.removed, state.missed)
            )

    def missed(self, model: str, version: int) -> None:
        """Record that a relay will never hold `version` of `model`, a version its upstream
        committed (evicted or deleted there before this relay fetched it, or one it cannot
        hold): watchers after an earlier version are told of the gap (`versions_after`,
        `gap_between`). For versions whose numbers are unknown, name the highest they may
        have (one below the version that follows them)."""
        state = self._model_state(validate_model_name(model))
        with self._lock:
            if not _contains(state.missed, version):
                bisect.insort(state.missed, version)

    def models(self) -> list[ModelInfo]:
        """Every model that has retained versions, sorted by name."""
        with self._lock:
            return [
                ModelInfo(
                    model=name,
                    latest_version=next(reversed(state.versions)),
                    version_count=len(state.versions),
                    retained_bytes=sum(v.byte_size for v in state.versions.values()),
                )
                for name, state in sorted(self._models.items())
                if state.versions
            ]

    def subscribe(self, listener: Callable[[Version], None]) -> Callable[[], None]:
        """Call `listener(version)` after every commit, in version order per model (from the
        committing thread, under that model's commit lock: it must not block). Exceptions are
        logged, not raised. Returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    # ------------------------------------------------------------------ admin
    def delete(self, model: str, version: int, *, evicted: bool = False) -> Version:
        """Delete one retained version, from disk first (see the module docstring for the order).

        `evicted`: the version goes because it was evicted elsewhere (a relay's upstream no
        longer retains it), not on request: asking for it later says it is no longer
        retained (VersionEvicted) rather than deleted."""
        self.get(model, version)  # raises the right NotFound before taking the commit lock
        state = self._model_state(model)
        with state.commit_lock:  # no commit, eviction or pin of this model meanwhile
            record = self.get(model, version)
            if self.data_dir is not None:
                self._delete_files(record, state.high_water)
            with self._lock:
                del state.versions[version]
                bisect.insort(state.removed, version)
                if not evicted:
                    state.deleted.add(version)
        return record

    def set_pinned(self, model: str, version: int, pinned: bool) -> Version:
        """Pin (keep beyond `keep`) or unpin a version; unpinning may evict it at once."""
        self.get(model, version)  # raises the right NotFound before taking the commit lock
        state = self._model_state(model)
        with state.commit_lock:
            updated = dataclasses.replace(self.get(model, version), pinned=pinned)
            if self.data_dir is not None:
                with self._disk_writes():
                    self._write_manifest(updated)
            with self._lock:
                if version not in state.versions:
                    raise VersionNotFound(f"model {model!r}: version {version} was removed concurrently")
                state.versions[version] = updated
                evicted = self._evict(state)
        self._remove_files(evicted)
        return updated

    # ------------------------------------------------------------------ background sha256
    def sha256_of(self, record: Version, *, hurry: bool = True) -> Future[str]:
        """A future of the sha256 of `record`'s bytes: done at once when it is known, else done
        when the background worker has hashed them (at once with `hurry`, a reader waiting for
        it; else after SHA256_DELAY_SECONDS). It fails with VersionNotFound when the
        version was evicted or deleted before it was hashed (its job is dropped; a caller still
        holding `record` may hash `record.data` itself), or ServerUnavailable once the store is
        closed. Nobody can cancel it: several callers may wait on the same one."""
        if record.sha256:
            return _done_future(record.sha256)
        with self._lock:
            pending = self._pending_sha256.get((record.model, record.version))
            if pending is not None:
                if hurry:
                    self._sha256_hurry.set()
                return pending
            state = self._models.get(record.model)
            current = state.versions.get(record.version) if state is not None else None
        if current is not None and current.sha256:
            return _done_future(current.sha256)
        failed: Future[str] = _running_future()
        failed.set_exception(self._gone(record.model, record.version))
        return failed

    def _worker(self) -> ThreadPoolExecutor | None:
        """The thread that computes sha256s after commits (started on first need); None once
        the store is closed."""
        with self._lock:
            if not self._closed and self._sha256_worker is None:
                self._sha256_worker = ThreadPoolExecutor(1, thread_name_prefix="weightserver-sha256")
            return self._sha256_worker

    def _hash_later(self, record: Version) -> None:
        """Queue `record` (just committed with sha256 "") for the background worker."""
        worker = self._worker()
        key, created = (record.model, record.version), record.created
        if worker is not None:
            # The key, not the record: a version deleted or evicted while its job waits is not
            # kept in memory by it.
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                worker.submit(self._hash_pending, key, created)
                return
        self._hash_pending(key, created)  # closed: fails the future at once

    def _hash_pending(self, key: tuple[str, int], created: float) -> None:
        """The worker's job: hash a retained version (model, version) committed at `created`
        once its delay is out, and put its sha256 in its record. A pin that
        replaced the record meanwhile is kept (both take the model's commit lock), and a later
        pin keeps the sha256 (it replaces the record this puts in place)."""
        model, version = key
        state = self._models[model]
        self._sha256_hurry.wait(max(0.0, created + SHA256_DELAY_SECONDS - time.time()))
        with self._lock:
            future = self._pending_sha256[key]
            record = state.versions.get(version)
            if self._closed or record is None:
                del self._pending_sha256[key]
                future.set_exception(self._gone(model, version))
                return
        digest = sha256_hex(record.data)
        with state.commit_lock, self._lock:
            current = state.versions.get(record.version)
            if current is not None:  # else deleted or evicted while it was being hashed
                state.versions[record.version] = dataclasses.replace(current, sha256=digest)
            del self._pending_sha256[key]
            if not self._pending_sha256:
                self._sha256_hurry.clear()  # none left that a reader waits for
        future.set_result(digest)

    def _gone(self, model: str, version: int) -> WeightServerError:
        """Why a pending sha256 will not be computed."""
        if self._closed:
            return ServerUnavailable(f"model {model!r} v{version}: the server is stopping")
        return VersionNotFound(
            f"model {model!r}: version {version} was evicted or deleted before its sha256 was computed"
        )

    def _retained(self, model: str) -> _Model:
        """The state of `model` if it retains versions, else ModelNotFound. Caller holds the lock."""
        state = self._models.get(validate_model_name(model))
        if state is None or not state.versions:
            names = [name for name, other in sorted(self._models.items()) if other.versions]
            raise ModelNotFound(f"no model {model!r} on this server; models: {_names(names) or 'none yet'}")
        return state

    # ------------------------------------------------------------------ persistence
    def _model_dir(self, model: str) -> Path:
        assert self.data_dir is not None
        return self.data_dir / model

    def _paths(self, model: str, version: int) -> tuple[Path, Path]:
        stem = self._model_dir(model) / f"{version:012d}"
        return stem.with_suffix(_DATA_SUFFIX), stem.with_suffix(_MANIFEST_SUFFIX)

    def _write_group(self, records: list[Version]) -> list[Version]:
        """Every data file first, then every manifest: a crash leaves either no manifest of the
        group (debris, removed on start) or some, which `_drop_torn_groups` detects. A write
        that fails removes what the group wrote, manifests first, so a full disk stays no fuller.

        A record without a sha256 is hashed in a thread while the data files are written and
        fsynced, so that its manifest carries it; returns the records with their sha256s."""
        hashing = {i: _hashed_aside(record.data) for i, record in enumerate(records) if not record.sha256}
        written: list[Path] = []
        try:
            with self._disk_writes():
                for record in records:
                    self._model_dir(record.model).mkdir(parents=True, exist_ok=True)
                    written.append(self._paths(record.model, record.version)[0])
                    _atomic_write(written[-1], record.data)
                records = [
                    dataclasses.replace(record, sha256=hashing[i].result()) if i in hashing else record
                    for i, record in enumerate(records)
                ]
                for record in records:
                    written.append(self._paths(record.model, record.version)[1])
                    self._write_manifest(record)
        except BaseException:
            for path in reversed(written):
                _remove_logged(path)
            raise
        return records

    @contextlib.contextmanager
    def _disk_writes(self) -> Iterator[None]:
        """Raise StorageFull, which says what to do, when the data directory has no space left."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StorageFull(
                f"the data directory {self.data_dir} is full ({exc.strerror}), so nothing was written "
                "or changed; free space by deleting versions (weightserver delete) or unpinning them, "
                "lower --keep, or give the data directory more space"
            ) from exc

    def _delete_files(self, record: Version, high_water: int) -> None:
        """Remove a deleted version's files: the data file first (that frees the space, and a
        manifest without its data file is never loaded again), then record the high-water mark,
        then the manifest, which until then keeps the version's number from being reused."""
        data_path, manifest_path = self._paths(record.model, record.version)
        data_path.unlink(missing_ok=True)
        try:
            with self._disk_writes():
                record_path = self._model_dir(record.model) / _HIGH_WATER
                _atomic_write(record_path, json.dumps({"high_water": high_water}).encode())
        except (StorageFull, OSError) as exc:
            log.warning("keeping %s so that its number is never reused: %s", manifest_path, exc)
            return
        _remove_logged(manifest_path)

    def _write_manifest(self, record: Version) -> None:
        _, manifest_path = self._paths(record.model, record.version)
        manifest = {
            "format": 1,
            "model": record.model,
            "version": record.version,
            "byte_size": record.byte_size,
            "sha256": record.sha256,
            "created": record.created,
            "metadata": dict(record.metadata),
            "pinned": record.pinned,
            "group": list(record.group),
        }
        if record.publish_id:  # so that a retry finds it after a restart too
            manifest["publish_id"] = record.publish_id
        _atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())

    def _remove_files(self, records: list[Version]) -> None:
        if self.data_dir is None:
            return
        for record in records:
            data_path, manifest_path = self._paths(record.model, record.version)
            # Manifest first: without it a leftover data file is debris, never a version.
            _remove_logged(manifest_path)
            _remove_logged(data_path)

    def _load(self) -> None:
        assert self.data_dir is not None
        for directory in sorted(p for p in self.data_dir.iterdir() if p.is_dir()):
            try:
                model = validate_model_name(directory.name)
            except InvalidModelName:
                log.warning("ignoring %s: not a valid model name", directory)
                continue
            state = self._models.setdefault(model, _Model())
            for tmp in directory.glob("*.tmp"):
                log.warning("removing %s: an unfinished write from before a crash", tmp)
                tmp.unlink(missing_ok=True)
            state.high_water = _read_high_water(directory / _HIGH_WATER)
            for record in self._load_model(model, directory):
                state.versions[record.version] = record
                state.high_water = max(state.high_water, record.version)
            # A manifest marks a committed version even when its files are damaged and it was
            # skipped: never hand its number out again (unless it is out of range).
            for manifest_path in directory.glob("*" + _MANIFEST_SUFFIX):
                stem = manifest_path.stem
                if stem.isascii() and stem.isdigit() and int(stem) <= MAX_VERSION:
                    state.high_water = max(state.high_water, int(stem))
        self._drop_torn_groups()
        for model, state in self._models.items():
            self._remove_files(self._evict(state))
            if state.versions:
                log.info(
                    "loaded model %r: versions %s (%d bytes)",
                    model,
                    _ranges(list(state.versions)),
                    sum(v.byte_size for v in state.versions.values()),
                )
        self._rebuild_publish_ids()

    def _drop_torn_groups(self) -> None:
        """Drop versions of a multi-model publish that a crash left incomplete.

        A member missing a group version that is above every version it has loaded never
        got its manifest written: the group did not commit. A member missing an older one
        merely evicted or deleted it, and the rest of the group stays.
        """
        for model, state in self._models.items():
            for number, record in list(state.versions.items()):
                for partner in record.group:
                    other = self._models.get(partner)
                    newest = max(other.versions, default=0) if other else 0
                    if partner != model and number not in (other.versions if other else {}) and number > newest:
                        log.error(
                            "skipping %s v%d: its group publish with %s did not complete before a crash",
                            model,
                            number,
                            partner,
                        )
                        del state.versions[number]
                        self._remove_files([record])
                        break

    def _load_model(self, model: str, directory: Path) -> Iterator[Version]:
        manifests = {p.stem: p for p in directory.glob("*" + _MANIFEST_SUFFIX) if p.name != _HIGH_WATER}
        for data_path in sorted(directory.glob("*" + _DATA_SUFFIX)):
            if data_path.stem not in manifests:
                log.warning("removing %s: data without a manifest (publish interrupted by a crash)", data_path)
                data_path.unlink(missing_ok=True)
        for _, manifest_path in sorted(manifests.items()):
            record = self._load_one(model, manifest_path, manifest_path.with_suffix(_DATA_SUFFIX))
            if record is not None:
                yield record

    def _load_one(self, model: str, manifest_path: Path, data_path: Path) -> Version | None:
        try:
            manifest = _check_manifest(json.loads(manifest_path.read_text()), manifest_path)
            data = data_path.read_bytes()
            if len(data) != manifest["byte_size"]:
                raise IntegrityError(f"{len(data)} bytes on disk, manifest says {manifest['byte_size']}")
            digest = sha256_hex(data)
            if digest != manifest["sha256"]:
                raise IntegrityError(f"sha256 on disk is {digest}, manifest says {manifest['sha256']}")
            header = parse_header(data)  # the format's limits: what was committed loads
            record = Version(
                model=model,
                version=manifest["version"],
                data=data,
                sha256=digest,
                created=float(manifest.get("created", 0.0)),
                metadata=dict(manifest.get("metadata", {})),
                header=header,
                pinned=manifest.get("pinned", False),
                group=tuple(manifest.get("group", ())),
                publish_id=manifest.get("publish_id", ""),
                xxh3=xxh3_hex(data),
                tensor_xxh3=tensor_digests(data, header),
            )
            if self._describe is not None:
                record = dataclasses.replace(record, description_bytes=self._describe(record))
            return record
        except Exception as exc:  # any damage: skip this version, keep the others
            log.error("skipping %s: torn or corrupt version (%s)", data_path, exc)
            return None


def _check_manifest(manifest: object, path: Path) -> dict:
    """`manifest` if every field has the type and range the server relies on; else ValueError.
    A manifest must name the version its file name says (a copied or edited manifest must not
    serve one version's bytes under another number)."""
    if not isinstance(manifest, dict):
        raise ValueError("the manifest is not a JSON object")
    version = manifest.get("version")
    if type(version) is not int or version < 1 or f"{version:012d}" != path.stem:
        raise ValueError(f"the manifest names version {version!r} but its file name says {path.stem}")
    if version > MAX_VERSION:
        raise ValueError(f"version {version} is over the largest version number, {MAX_VERSION}")
    if type(manifest.get("byte_size")) is not int or not isinstance(manifest.get("sha256"), str):
        raise ValueError("byte_size must be an integer and sha256 a string")
    created = manifest.get("created", 0.0)
    if type(created) not in (int, float) or not 0 <= created < 1e11:  # also rules out NaN and inf
        raise ValueError(f"created must be a Unix time, got {created!r}")
    metadata = manifest.get("metadata", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("metadata must map strings to strings")
    group = manifest.get("group", [])
    if not isinstance(group, list) or not all(isinstance(g, str) and _MODEL_NAME.fullmatch(g) for g in group):
        raise ValueError("group must be a list of model names")
    if not isinstance(manifest.get("pinned", False), bool):
        raise ValueError("pinned must be true or false")
    publish_id = manifest.get("publish_id", "")
    if not isinstance(publish_id, str) or not (publish_id == "" or _PUBLISH_ID.fullmatch(publish_id)):
        raise ValueError("publish_id must be empty or up to 128 printable ASCII characters")
    return manifest


def _read_high_water(path: Path) -> int:
    try:
        value = json.loads(path.read_text())["high_water"]
        if type(value) is not int or not 0 <= value <= MAX_VERSION:
            raise ValueError(f"high_water must be an integer in 0-{MAX_VERSION}, got {value!r}")
        return value
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError, OverflowError, OSError) as exc:
        log.error("ignoring %s: %s", path, exc)
        return 0


def _atomic_write(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one, and a
    failed write (a full disk) leaves no temp file behind."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _remove_logged(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _remove_logged(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _call_logged(callback: Callable[[Version], None], record: Version) -> None:
    """Run a commit hook or listener: its failure is logged, the commit stands."""
    try:
        callback(record)
    except Exception:
        log.exception("%r failed on %s v%d", callback, record.model, record.version)


def _hashed_aside(data: bytes | bytearray | memoryview) -> Future[str]:
    """The sha256 of `data`, computed in a thread of its own while the caller goes on (hashlib
    lets go of the GIL)."""
    future = _running_future()

    def run() -> None:
        try:
            future.set_result(sha256_hex(data))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weightserver-sha256", daemon=True).start()
    return future


def _running_future() -> Future[str]:
    """A future that nobody can cancel (it is marked running): for sha256s several callers wait on."""
    future: Future[str] = Future()
    future.set_running_or_notify_cancel()
    return future


def _done_future(result: str) -> Future[str]:
    future = _running_future()
    future.set_result(result)
    return future


def _checked_publish_id(publish_id: str) -> str:
    if publish_id and not _PUBLISH_ID.fullmatch(publish_id):
        raise InvalidRequest(
            f"invalid publish id {publish_id[:200]!r}: use 1-128 printable ASCII characters without spaces "
            "(e.g. a random UUID), or none"
        )
    return publish_id


def _committed_by(state: _Model, publish_id: str) -> Version | None:
    """The retained version of a model that a publish with `publish_id` committed, if any."""
    if publish_id:
        for record in state.versions.values():
            if record.publish_id == publish_id:
                return record
    return None


def _repeated(
    names: Sequence[str], states: Mapping[str, _Model], verified: Sequence[Version], publish_id: str
) -> list[Version] | None:
    """The versions an earlier publish with `publish_id` committed, when this publish repeats
    it (same models, same bytes); None when no retained version carries the id."""
    found = [_committed_by(states[name], publish_id) for name in names]
    first = next((record for record in found if record is not None), None)
    if first is None:
        return None
    if set(first.group or (first.model,)) != set(names):
        raise InvalidRequest(
            f"publish id {publish_id!r} was already used by version {first.version} of "
            f"{_names(first.group or (first.model,))}; a retry sends the same models, a new publish needs a new id"
        )
    repeated = []
    for name, record, new in zip(names, found, verified, strict=True):
        if record is None or record.version != first.version:
            raise VersionConflict(
                f"publish id {publish_id!r} committed version {first.version} of {_names(names)}, but {name!r} "
                "no longer retains it (evicted or deleted); nothing was published again"
            )
        if record.xxh3 != new.xxh3:
            raise InvalidRequest(
                f"publish id {publish_id!r} was already used by version {record.version} of {name!r} with other "
                "bytes; a retry sends the same bytes, a new publish needs a new id"
            )
        repeated.append(record)
    return repeated


def _metadata_bytes(metadata: Mapping[str, str]) -> int:
    return sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _check_version(names: Sequence[str], version: int, high_water: int) -> None:
    """A requested `version` (0: the next one) must exceed every version the models ever had
    and be at most MAX_VERSION."""
    if version > MAX_VERSION:
        raise VersionTooLarge(
            f"model {_names(names)}: requested version {version} is over the largest version number, "
            f"{MAX_VERSION} (2^63-1); ask for a smaller one or leave it unset (0) to get the next one"
        )
    if version and version <= high_water:
        raise VersionConflict(
            f"model {_names(names)}: requested version {version} is not greater than the latest version "
            f"{high_water}; ask for a version > {high_water} or leave it unset (0) to get the next one"
        )
    if not version and high_water >= MAX_VERSION:
        raise VersionConflict(
            f"model {_names(names)}: the latest version is {high_water}, the largest version number "
            "(2^63-1), so no version can follow it; publish under another model name"
        )


def _contains(sorted_numbers: list[int], number: int) -> bool:
    i = bisect.bisect_left(sorted_numbers, number)
    return i < len(sorted_numbers) and sorted_numbers[i] == number


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive numbers
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs) or "none"
