"""A commit's checks: limits, digests, header, version numbers, publish ids (a retry never makes a second version)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from weightserver.protocol import digests, errors
from weightserver.protocol.limits import MAX_DESCRIPTION_BYTES, MAX_DESCRIPTIONS_PER_REPLY
from weightserver.protocol.safetensors_format import parse_header
from weightserver.storage.index import MAX_VERSION, ModelState, Version, quoted

NEW_ID = "a retry sends the same models and bytes, a new publish needs a new id"
REPLY_LIMIT = f"the {MAX_DESCRIPTIONS_PER_REPLY} bytes one reply may carry to a gRPC client with default settings"
DESCRIPTION_LIMIT = f"limit of {MAX_DESCRIPTION_BYTES} bytes on a version's description (what a gRPC client takes)"


@dataclass(frozen=True)
class Upload:
    """One model's bytes and what the publisher declared; `digests`: computed as the bytes arrived."""

    model: str
    data: bytes | bytearray | memoryview = field(repr=False)
    sha256: str | None = None
    total_bytes: int | None = None
    metadata: Mapping[str, str] | None = None
    pin: bool = False
    digests: digests.FileDigests | None = field(default=None, repr=False)
    xxh3: str | None = None


@dataclass(frozen=True)
class Commit:
    """The event of one publish's commit (see `VersionStore.commit`)."""

    versions: tuple[Version, ...]  # in the uploads' order
    publish_id: str = ""
    replayed: bool = False  # a retry of `publish_id`: the versions it committed before, nothing new
    evicted: tuple[Version, ...] = ()  # versions the commit evicted, known once it is visible
    visible: bool = False


@dataclass(frozen=True)
class Checks:
    max_model_bytes: int | None
    header_limits: dict[str, int]
    describe: Callable[[Version], int] | None

    def size(self, model: str, size: int) -> None:
        if self.max_model_bytes is not None and size > self.max_model_bytes:
            limit = f"the server's limit of {self.max_model_bytes} bytes (--max-model-bytes)"
            raise errors.ModelTooLarge(f"model {model!r}: {size} bytes is over {limit}")

    def metadata(self, model: str, metadata: Mapping[str, str]) -> None:
        size = sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())
        if self.describe is not None and size > MAX_DESCRIPTION_BYTES:
            raise errors.DescriptionTooLarge(
                f"model {model!r}: {size} bytes of metadata are over the {DESCRIPTION_LIMIT}; publish less metadata"
            )

    def verify(self, upload: Upload, group: tuple[str, ...]) -> Version:
        """One upload's Version, not yet numbered; its sha256 is left for later when just an xxh3 was declared."""
        model, size, data, found = upload.model, len(upload.data), upload.data, upload.digests
        if upload.total_bytes is not None and upload.total_bytes != size:
            raise errors.IntegrityError(
                f"model {model!r}: publisher declared {upload.total_bytes} bytes but sent {size}; "
                "the upload was cut short or the header is wrong"
            )
        self.size(model, size)
        if found is not None and found.declared and (upload.sha256 is not None or upload.xxh3 is None):
            found = digests.rehashed(data, found.header)  # a pass for the sha256 now: no digest taken unread
        xxh3 = found.xxh3 if found is not None else digests.xxh3_hex(data)
        _check_declared(model, "xxh3", upload.xxh3, xxh3)
        sha256 = found.sha256 if found is not None else None
        if sha256 is None and (upload.sha256 is not None or upload.xxh3 is None):
            sha256 = digests.sha256_hex(data)
        _check_declared(model, "sha256", upload.sha256, sha256)
        header = found.header if found is not None else parse_header(data, **self.header_limits)
        record = Version(
            model=model,
            data=data,
            sha256=sha256 or "",
            metadata=dict(upload.metadata or {}),
            header=header,
            pinned=upload.pin,
            group=group,
            xxh3=xxh3,
            tensor_xxh3=found.tensor_xxh3 if found is not None else digests.tensor_digests(data, header),
            declared=found is not None and found.declared,
        )
        if self.describe is None:
            return record
        # Measured at its largest: the largest number, pinned, its sha256 known
        largest = dataclasses.replace(record, version=MAX_VERSION, created=time.time(), pinned=True, sha256="0" * 64)
        size = self.describe(largest)
        if size > MAX_DESCRIPTION_BYTES:
            raise errors.DescriptionTooLarge(
                f"model {model!r}: the description of {len(header.tensors)} tensors and {len(record.metadata)} metadata"
                f" entries would be {size} bytes, over the {DESCRIPTION_LIMIT}; publish fewer tensors (split the model"
                " into a group) or less metadata"
            )
        return dataclasses.replace(record, description_bytes=size)

    @staticmethod
    def reply(verified: Sequence[Version]) -> None:
        """The Publish reply lists every model's description, and the first one once more."""
        reply_bytes = verified[0].description_bytes + sum(v.description_bytes for v in verified)
        if reply_bytes > MAX_DESCRIPTIONS_PER_REPLY:
            raise errors.DescriptionTooLarge(
                f"model {quoted([v.model for v in verified])}: the descriptions of this publish add up to "
                f"{reply_bytes} bytes, over {REPLY_LIMIT}; publish fewer models at once"
            )

    @staticmethod
    def listing(state: ModelState, record: Version, keep: int) -> None:
        """The descriptions retained with `record` must fit one ListVersions reply. Caller holds the lock."""
        versions = [*state.versions.values(), record]
        retained = [v for v in versions if v.pinned] + [v for v in versions if not v.pinned][-keep:]
        total = sum(v.description_bytes for v in retained)
        if total > MAX_DESCRIPTIONS_PER_REPLY:
            raise errors.DescriptionTooLarge(
                f"model {record.model!r}: with this version the descriptions of its retained versions would add up "
                f"to {total} bytes, over {REPLY_LIMIT} (ListVersions reply); unpin or delete versions, or lower --keep"
            )


class PublishIds:
    """Retained versions by publish id (checked on use: maybe gone), and the ids committing now; under the lock."""

    def __init__(self, models: dict[str, ModelState]) -> None:
        self._models = models
        self._index: dict[str, list[tuple[str, int]]] = {}
        self._rebuilt = 0  # its size when last rebuilt
        self.committing: dict[str, tuple[str, ...]] = {}  # publish id -> its models

    def add(self, record: Version) -> None:
        self._index.setdefault(record.publish_id, []).append((record.model, record.version))
        if len(self._index) > 2 * self._rebuilt + 1024:
            self.rebuild()

    def rebuild(self) -> None:
        self._index = {}
        for record in (r for state in self._models.values() for r in state.versions.values() if r.publish_id):
            self._index.setdefault(record.publish_id, []).append((record.model, record.version))
        self._rebuilt = len(self._index)

    def check(self, names: Sequence[str], publish_id: str, verified: Sequence[Version] | None = None) -> list | None:
        """What an earlier publish with `publish_id` committed when this one repeats it, else None; InvalidRequest
        when other models used it. `verified` None: before the bytes, and `names` may be part of a group."""
        if not publish_id:
            return None
        retained = [self._models[name].versions.values() if name in self._models else () for name in names]
        found = [next((r for r in versions if r.publish_id == publish_id), None) for versions in retained]
        first = next((record for record in found if record is not None), None)
        if first is not None:
            if verified is None:  # a retry's header: its bytes are checked at the commit
                return found
            if set(first.group or (first.model,)) != set(names):
                raise errors.InvalidRequest(
                    f"publish id {publish_id!r} was already used by version {first.version} of "
                    f"{quoted(first.group or (first.model,))}; {NEW_ID}"
                )
            for name, record, new in zip(names, found, verified, strict=True):
                if record is None or record.version != first.version:
                    raise errors.VersionConflict(
                        f"publish id {publish_id!r} committed version {first.version} of {quoted(names)}, but "
                        f"{name!r} no longer retains it (evicted or deleted); nothing was published again"
                    )
                if record.xxh3 != new.xxh3:
                    raise errors.InvalidRequest(
                        f"publish id {publish_id!r} was already used by version {record.version} of {name!r} with "
                        f"other bytes; {NEW_ID}"
                    )
            return found
        committing = self.committing.get(publish_id)
        if committing is not None and not set(committing) & set(names):
            raise errors.InvalidRequest(
                f"publish id {publish_id!r} belongs to a publish of {quoted(committing)} committing now; {NEW_ID}"
            )
        for model, number in self._index.get(publish_id, ()):
            record = self._models[model].versions.get(number) if model in self._models else None
            if record is None or record.publish_id != publish_id:
                continue
            models = record.group or (record.model,)
            if record.model not in names and not (verified is None and set(names) <= set(models)):
                raise errors.InvalidRequest(
                    f"publish id {publish_id!r} was already used by version {record.version} of "
                    f"{quoted(models)}; {NEW_ID}"
                )
        return None


def _check_declared(model: str, name: str, declared: str | None, actual: str | None) -> None:
    if declared is not None and declared.lower() != actual:
        raise errors.IntegrityError(
            f"model {model!r}: {name} of the received bytes is {actual}, publisher declared "
            f"{declared.lower()}; the bytes were corrupted in transit or the digest is wrong"
        )


def check_version(names: Sequence[str], version: int, high_water: int) -> None:
    """A requested `version` (0: the next one) must exceed every version the models had, up to MAX_VERSION."""
    if version > MAX_VERSION:
        raise errors.VersionTooLarge(
            f"model {quoted(names)}: requested version {version} is over the largest version number, "
            f"{MAX_VERSION} (2^63-1); ask for a smaller one or leave it unset (0) to get the next one"
        )
    if version and version <= high_water:
        raise errors.VersionConflict(
            f"model {quoted(names)}: requested version {version} is not greater than the latest version "
            f"{high_water}; ask for a version > {high_water} or leave it unset (0) to get the next one"
        )
    if not version and high_water >= MAX_VERSION:
        raise errors.VersionConflict(
            f"model {quoted(names)}: the latest version is {high_water}, the largest version number "
            "(2^63-1), so no version can follow it; publish under another model name"
        )
