"""Conversions between the store's records and the protobuf messages of weights.proto."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from weightserver.store import ModelInfo, Version
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
