"""A version's description: the one conversion between weights.proto's VersionInfo and Python. The
server builds the message from its record (`version_message`); a client reads it back (`VersionInfo.from_proto`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from weightserver.protocol.safetensors_format import TensorEntry
from weightserver.v1 import weights_pb2 as pb


class SelectionRecord(Protocol):
    """What a server keeps of a selection's file (the payload cache's SelectionManifest)."""

    byte_size: int
    xxh3: str
    header: Any  # its safetensors header: `.tensors`, each a TensorEntry
    tensor_xxh3: Mapping[str, str]


class VersionRecord(SelectionRecord, Protocol):
    """What a server keeps of a version that its description is built from (the store's record)."""

    model: str
    version: int
    sha256: str
    created: float  # seconds since the epoch
    metadata: Mapping[str, str]
    pinned: bool
    group: tuple[str, ...]


# The fields a VersionInfo message and its Python form share, name and value alike.
_SAME_FIELDS = ("model", "version", "byte_size", "sha256", "pinned", "xxh3")


class SummaryRecord(Protocol):
    model: str
    latest_version: int
    version_count: int
    retained_bytes: int


def _tensor_messages(record: VersionRecord | SelectionRecord) -> list[pb.TensorInfo]:
    digest = record.tensor_xxh3.get
    return [
        pb.TensorInfo(
            name=t.name, dtype=t.dtype, shape=t.shape, data_begin=t.begin, data_end=t.end, xxh3=digest(t.name, "")
        )
        for t in record.header.tensors
    ]


def selection_message(record: SelectionRecord) -> pb.SelectionInfo:
    return pb.SelectionInfo(byte_size=record.byte_size, xxh3=record.xxh3, tensors=_tensor_messages(record))


def version_message(record: VersionRecord) -> pb.VersionInfo:
    created = Timestamp()
    created.FromNanoseconds(int(record.created * 1e9))
    return pb.VersionInfo(
        **{name: getattr(record, name) for name in _SAME_FIELDS},
        created=created,
        metadata=dict(record.metadata),
        tensors=_tensor_messages(record),
        group=list(record.group),
    )


def description_bytes(record: VersionRecord) -> int:
    """Bytes of `record`'s description as clients receive it."""
    return version_message(record).ByteSize()


def summary_message(info: SummaryRecord) -> pb.ModelSummary:
    return pb.ModelSummary(**{f.name: getattr(info, f.name) for f in fields(ModelSummary)})


@dataclass(frozen=True)
class TensorInfo(TensorEntry):
    """A tensor of a version's manifest, with the xxh3-128 of its bytes."""

    xxh3: str = ""


@dataclass(frozen=True)
class VersionInfo:
    """Everything about one version except its bytes."""

    model: str
    version: int
    byte_size: int
    sha256: str
    created: datetime
    metadata: dict[str, str] = field(default_factory=dict)
    tensors: tuple[TensorInfo, ...] = ()
    pinned: bool = False
    group: tuple[str, ...] = ()  # models published together under this version number
    xxh3: str = ""  # xxh3-128 of the whole file ("" from servers that predate it)
    created_ns: int = field(default=0, compare=False, repr=False)  # `created` exactly (a relay keeps it)

    @classmethod
    def from_proto(cls, message: pb.VersionInfo) -> VersionInfo:
        created_ns = message.created.ToNanoseconds()
        return cls(
            **{name: getattr(message, name) for name in _SAME_FIELDS},
            created=datetime.fromtimestamp(created_ns / 1e9, tz=UTC),
            metadata=dict(message.metadata),
            tensors=_tensors(message.tensors),
            group=tuple(message.group),
            created_ns=created_ns,
        )

    def selected(self, selection: pb.SelectionInfo) -> VersionInfo:
        """This version seen through a selection: its number and metadata, the selection file's size,
        digest and tensors (no sha256: the server computes none for a selection)."""
        return replace(
            self, byte_size=selection.byte_size, sha256="", xxh3=selection.xxh3, tensors=_tensors(selection.tensors)
        )


def _tensors(messages: Iterable[pb.TensorInfo]) -> tuple[TensorInfo, ...]:
    return tuple(TensorInfo(t.name, t.dtype, tuple(t.shape), t.data_begin, t.data_end, t.xxh3) for t in messages)


@dataclass(frozen=True)
class ModelSummary:
    """A model and its retained versions at a glance."""

    model: str
    latest_version: int
    version_count: int
    retained_bytes: int

    @classmethod
    def from_proto(cls, message: pb.ModelSummary) -> ModelSummary:
        return cls(*(getattr(message, f.name) for f in fields(cls)))


@dataclass(frozen=True)
class VersionEvent:
    """A Watch event: a version landed. `gap` is True when versions were missed for good.
    `incoming`: on a watch of incoming publishes, the id of the announced bytes (`IncomingEvent`)
    that became this version, if they were announced."""

    info: VersionInfo
    gap: bool = False
    incoming: str = ""

    @property
    def version(self) -> int:
        return self.info.version


@dataclass(frozen=True)
class IncomingEvent:
    """A Watch announcement (`watch(..., incoming=True)`): a publish's bytes began to arrive
    at the server, so they can be fetched before the commit (`fetch_incoming`), and applied
    once a `VersionEvent` names `id` and they match its xxh3. `failed`: that publish failed;
    its bytes never become a version."""

    model: str
    id: str
    byte_size: int
    failed: bool = False
