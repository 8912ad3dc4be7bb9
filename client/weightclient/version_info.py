"""VersionInfo: a version's description as plain Python (from weights.proto's VersionInfo)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from weightserver.safetensors_format import TensorEntry
from weightserver.v1 import weights_pb2 as pb


@dataclass(frozen=True)
class VersionInfo:
    """Everything about one version except its bytes."""

    model: str
    version: int
    byte_size: int
    sha256: str
    created: datetime
    metadata: dict[str, str] = field(default_factory=dict)
    tensors: tuple[TensorEntry, ...] = ()
    pinned: bool = False
    group: tuple[str, ...] = ()  # models published together under this version number

    @classmethod
    def from_proto(cls, message: pb.VersionInfo) -> VersionInfo:
        return cls(
            model=message.model,
            version=message.version,
            byte_size=message.byte_size,
            sha256=message.sha256,
            created=datetime.fromtimestamp(message.created.ToNanoseconds() / 1e9, tz=timezone.utc),
            metadata=dict(message.metadata),
            tensors=tuple(
                TensorEntry(t.name, t.dtype, tuple(t.shape), t.data_begin, t.data_end) for t in message.tensors
            ),
            pinned=message.pinned,
            group=tuple(message.group),
        )


@dataclass(frozen=True)
class ModelSummary:
    """A model and its retained versions at a glance."""

    model: str
    latest_version: int
    version_count: int
    retained_bytes: int

    @classmethod
    def from_proto(cls, message: pb.ModelSummary) -> ModelSummary:
        return cls(message.model, message.latest_version, message.version_count, message.retained_bytes)


@dataclass(frozen=True)
class VersionEvent:
    """A Watch event: a version landed. `gap` is True when versions were missed for good."""

    info: VersionInfo
    gap: bool = False

    @property
    def version(self) -> int:
        return self.info.version
