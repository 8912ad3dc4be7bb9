"""The index: each model's committed versions, its retention, high-water mark and gaps, and the reads."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightserver.protocol.errors import CursorOutOfRange, ModelNotFound, VersionEvicted, VersionNotFound
from weightserver.protocol.names import validate_model_name
from weightserver.protocol.safetensors_format import SafetensorsHeader

MAX_VERSION = 2**63 - 1  # fits a signed 64-bit integer, and the next one the proto's uint64


@dataclass(frozen=True, kw_only=True)
class Version:
    """One committed, verified version. Immutable: a pin or a late sha256 replaces the record."""

    model: str
    version: int = 0
    data: bytes | bytearray | memoryview = field(repr=False)
    sha256: str = ""  # "" until the background worker has hashed it
    created: float = 0.0
    metadata: Mapping[str, str] = field(default_factory=dict)
    header: SafetensorsHeader = field(repr=False)
    pinned: bool = False
    group: tuple[str, ...] = ()  # models committed together under this version number
    xxh3: str = ""  # xxh3-128 of the whole file
    tensor_xxh3: Mapping[str, str] = field(default_factory=dict, repr=False)  # per tensor, by name
    description_bytes: int = 0  # its description as clients receive it, at most (0: not measured)
    publish_id: str = ""  # the idempotency key of the publish that committed it
    declared: bool = False  # its xxh3s are its publisher's, unchecked until the sha256 pass

    @property
    def byte_size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class ModelInfo:
    model: str
    latest_version: int
    version_count: int
    retained_bytes: int


class NumberRuns:
    """A set of version numbers as the edges of sorted, disjoint runs [start, stop): a number is held where an odd
    count of edges lie at or below it. Its size grows with the runs, not the numbers: retention evicts the oldest
    versions, so evictions extend one run; pins and deletes leave holes, each one more run."""

    def __init__(self) -> None:
        self._edges: list[int] = []  # start, stop, start, stop, ...

    def add(self, number: int) -> None:
        i = bisect.bisect_right(self._edges, number)
        if i % 2:
            return  # held already
        self._edges[i:i] = [number, number + 1]
        if i + 2 < len(self._edges) and self._edges[i + 2] == number + 1:  # it meets the next run: one run
            del self._edges[i + 1 : i + 3]
        if i and self._edges[i - 1] == number:  # and the run before
            del self._edges[i - 1 : i + 1]

    def __contains__(self, number: int) -> bool:
        return bisect.bisect_right(self._edges, number) % 2 == 1

    def any_between(self, after: int, before: int) -> bool:
        """Whether a number n with after < n < before is held."""
        i = bisect.bisect_right(self._edges, after + 1)  # odd: after + 1 is held; else edges[i] is the next start
        return after + 1 < before and (i % 2 == 1 or (i < len(self._edges) and self._edges[i] < before))

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The runs, [start, stop) each, in order."""
        return list(zip(self._edges[::2], self._edges[1::2], strict=True))


@dataclass
class ModelState:
    versions: dict[int, Version] = field(default_factory=dict)  # insertion order == version order
    high_water: int = 0  # highest version ever committed, retained or not
    removed: NumberRuns = field(default_factory=NumberRuns)  # evicted or deleted (this process)
    deleted: set[int] = field(default_factory=set)  # deleted on request (this process)
    missed: NumberRuns = field(default_factory=NumberRuns)  # upstream versions a relay will never hold
    commit_lock: threading.Lock = field(default_factory=threading.Lock)

    def evict(self, keep: int) -> list[Version]:
        """Retention: drop the unpinned versions beyond the `keep` newest; the dropped. Under the lock."""
        unpinned = [v for v in self.versions.values() if not v.pinned]
        doomed = unpinned[: max(0, len(unpinned) - keep)]
        for record in doomed:
            del self.versions[record.version]
            self.removed.add(record.version)
        return doomed

    def gap(self, after: int, before: int) -> bool:
        """Whether a version between `after` and `before` (excluded) was removed or missed."""
        return self.removed.any_between(after, before) or self.missed.any_between(after, before)


class VersionIndex:
    """Models by name and the reads on them; `_lock` guards every ModelState."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelState] = {}

    def latest(self, model: str) -> Version:
        with self._lock:
            return next(reversed(self._retained(model).versions.values()))

    def get(self, model: str, version: int) -> Version:
        with self._lock:
            state = self._retained(model)
            if version in state.versions:
                return state.versions[version]
            retained = list(state.versions)
            if version in state.deleted:
                raise VersionNotFound(
                    f"model {model!r}: version {version} was deleted; retained versions: {ranges(retained)}"
                )
            if 0 < version <= state.high_water and (version < retained[0] or version in state.removed):
                raise VersionEvicted(
                    f"model {model!r}: version {version} is no longer retained; the oldest retained is {retained[0]} "
                    f"(retained versions: {ranges(retained)}); pin versions you need to keep"
                )
            raise VersionNotFound(f"model {model!r} has no version {version}; retained versions: {ranges(retained)}")

    def newer_than(self, model: str, version: int) -> Version | None:
        """The latest version if it is newer than `version`, else None."""
        with self._lock:
            state = self._retained(model)
            latest, high_water = next(reversed(state.versions.values())), state.high_water
        if version > latest.version:
            why = (
                f"the versions after it, up to {high_water}, were deleted; fetch without newer_than to get it"
                if version <= high_water
                else "the server may have restarted without --data-dir, or the version came from another server"
            )
            raise CursorOutOfRange(
                f"model {model!r}: version {version} is ahead of the latest version {latest.version}; {why}"
            )
        return latest if latest.version > version else None

    def versions(self, model: str) -> list[Version]:
        with self._lock:
            return list(self._retained(model).versions.values())

    def versions_after(self, model: str, since: int) -> tuple[list[Version], bool]:
        """Retained versions newer than `since`, oldest first, and whether one after `since` is missing."""
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
            return [v for v in state.versions.values() if v.version > since], state.gap(since, MAX_VERSION + 1)

    def gap_between(self, model: str, after: int, before: int) -> bool:
        """Whether a watcher that saw `after` and then sees `before` missed a version."""
        with self._lock:
            state = self._models.get(model)
            return state is not None and state.gap(after, before)

    def missed(self, model: str, version: int) -> None:
        """A relay will never hold `version` of its upstream (or up to it): watchers hear of the gap."""
        state = self._model_state(validate_model_name(model))
        with self._lock:
            state.missed.add(version)

    def models(self) -> list[ModelInfo]:
        with self._lock:
            held = [(name, s.versions) for name, s in sorted(self._models.items()) if s.versions]
            return [ModelInfo(m, next(reversed(v)), len(v), sum(r.byte_size for r in v.values())) for m, v in held]

    def _model_state(self, model: str) -> ModelState:
        with self._lock:
            return self._models.setdefault(model, ModelState())

    def _retained(self, model: str) -> ModelState:
        """`model`'s state if it retains versions, else ModelNotFound. Caller holds the lock."""
        state = self._models.get(validate_model_name(model))
        if state is None or not state.versions:
            names = [name for name, other in sorted(self._models.items()) if other.versions]
            raise ModelNotFound(f"no model {model!r} on this server; models: {quoted(names) or 'none yet'}")
        return state


def quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    runs = [[n for _, n in run] for _, run in itertools.groupby(enumerate(numbers), lambda item: item[1] - item[0])]
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs) or "none"
