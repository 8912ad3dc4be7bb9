"""Conversions between the store's records and the protobuf messages of weights.proto."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from weightserver.protocol.errors import InvalidRequest
from weightserver.storage.store import ModelInfo, Version
from weightserver.v1 import weights_pb2 as pb


def version_info(record: Version) -> pb.VersionInfo:
    created = Timestamp()
    created.FromNanoseconds(int(record.created * 1e9))
    return pb.VersionInfo(
        model=record.model,
        version=record.version,
        byte_size=record.byte_size,
        sha256=record.sha256,
        created=created,
        metadata=dict(record.metadata),
        tensors=[
            pb.TensorInfo(
                name=t.name,
                dtype=t.dtype,
                shape=list(t.shape),
                data_begin=t.begin,
                data_end=t.end,
                xxh3=record.tensor_xxh3.get(t.name, ""),
            )
            for t in record.header.tensors
        ],
        pinned=record.pinned,
        group=list(record.group),
        xxh3=record.xxh3,
    )


def description_bytes(record: Version) -> int:
    """Bytes of `record`'s description (VersionInfo) as clients receive it."""
    return version_info(record).ByteSize()


def model_summary(info: ModelInfo) -> pb.ModelSummary:
    return pb.ModelSummary(
        model=info.model,
        latest_version=info.latest_version,
        version_count=info.version_count,
        retained_bytes=info.retained_bytes,
    )


@dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse (a text field that is not UTF-8, a truncated
    message), handed to the handler in its place: raised in gRPC's deserializer, the error
    would end the call with INTERNAL, as if the server had failed."""

    message_type: str
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(
            f"a {self.message_type} message could not be parsed ({self.reason}); text fields (model names, "
            "publish ids, upload ids, metadata) must be valid UTF-8, and a publish id 1-128 printable ASCII "
            "characters without spaces"
        )


def lenient(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer for `message_class` that returns an Undecodable instead of raising."""

    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_class.__name__, str(exc).rpartition(": ")[2] or "malformed")

    return deserialize
