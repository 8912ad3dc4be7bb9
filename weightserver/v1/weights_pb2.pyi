import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ElementDelta(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ELEMENT_DELTA_UNSPECIFIED: _ClassVar[ElementDelta]
    ELEMENT_DELTA_SPARSE: _ClassVar[ElementDelta]
    ELEMENT_DELTA_BITMAP: _ClassVar[ElementDelta]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_STREAM: _ClassVar[Transport]
    TRANSPORT_BULK: _ClassVar[Transport]
    TRANSPORT_SHARED_MEMORY: _ClassVar[Transport]

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    DIRECTION_FETCH: _ClassVar[Direction]
    DIRECTION_PUBLISH: _ClassVar[Direction]
ELEMENT_DELTA_UNSPECIFIED: ElementDelta
ELEMENT_DELTA_SPARSE: ElementDelta
ELEMENT_DELTA_BITMAP: ElementDelta
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_STREAM: Transport
TRANSPORT_BULK: Transport
TRANSPORT_SHARED_MEMORY: Transport
DIRECTION_UNSPECIFIED: Direction
DIRECTION_FETCH: Direction
DIRECTION_PUBLISH: Direction

class PublishRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit", "uploaded", "written")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    chunk: bytes
    commit: PublishCommit
    uploaded: PublishUploaded
    written: PublishWritten
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., commit: _Optional[_Union[PublishCommit, _Mapping]] = ..., uploaded: _Optional[_Union[PublishUploaded, _Mapping]] = ..., written: _Optional[_Union[PublishWritten, _Mapping]] = ...) -> None: ...

class PublishWritten(_message.Message):
    __slots__ = ("upload", "end")
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    upload: str
    end: int
    def __init__(self, upload: _Optional[str] = ..., end: _Optional[int] = ...) -> None: ...

class PublishUploaded(_message.Message):
    __slots__ = ("upload", "xxh3", "tensor_xxh3")
    class TensorXxh3Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_XXH3_FIELD_NUMBER: _ClassVar[int]
    upload: str
    xxh3: str
    tensor_xxh3: _containers.ScalarMap[str, str]
    def __init__(self, upload: _Optional[str] = ..., xxh3: _Optional[str] = ..., tensor_xxh3: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PublishCommit(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sha256: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("model", "version", "metadata", "total_bytes", "sha256", "pin", "publish_id", "xxh3")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_ID_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    metadata: _containers.ScalarMap[str, str]
    total_bytes: int
    sha256: str
    pin: bool
    publish_id: str
    xxh3: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., pin: _Optional[bool] = ..., publish_id: _Optional[str] = ..., xxh3: _Optional[str] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "versions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data_begin", "data_end", "xxh3")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_END_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data_begin: int
    data_end: int
    xxh3: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data_begin: _Optional[int] = ..., data_end: _Optional[int] = ..., xxh3: _Optional[str] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("model", "version", "byte_size", "sha256", "created", "metadata", "tensors", "pinned", "group", "xxh3")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    byte_size: int
    sha256: str
    created: _timestamp_pb2.Timestamp
    metadata: _containers.ScalarMap[str, str]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    pinned: bool
    group: _containers.RepeatedScalarFieldContainer[str]
    xxh3: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., byte_size: _Optional[int] = ..., sha256: _Optional[str] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., pinned: _Optional[bool] = ..., group: _Optional[_Iterable[str]] = ..., xxh3: _Optional[str] = ...) -> None: ...

class GetLatestRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model", "version", "newer_than", "incoming", "chunk_size", "base_version", "element_deltas", "dtype", "select")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    INCOMING_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_DELTAS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    newer_than: int
    incoming: str
    chunk_size: int
    base_version: int
    element_deltas: _containers.RepeatedScalarFieldContainer[ElementDelta]
    dtype: str
    select: Selection
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., newer_than: _Optional[int] = ..., incoming: _Optional[str] = ..., chunk_size: _Optional[int] = ..., base_version: _Optional[int] = ..., element_deltas: _Optional[_Iterable[_Union[ElementDelta, str]]] = ..., dtype: _Optional[str] = ..., select: _Optional[_Union[Selection, _Mapping]] = ...) -> None: ...

class Selection(_message.Message):
    __slots__ = ("rules", "rest")
    RULES_FIELD_NUMBER: _ClassVar[int]
    REST_FIELD_NUMBER: _ClassVar[int]
    rules: _containers.RepeatedCompositeFieldContainer[TensorRule]
    rest: bool
    def __init__(self, rules: _Optional[_Iterable[_Union[TensorRule, _Mapping]]] = ..., rest: _Optional[bool] = ...) -> None: ...

class TensorRule(_message.Message):
    __slots__ = ("name", "prefix", "glob", "slice")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    GLOB_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    prefix: str
    glob: str
    slice: Slice
    def __init__(self, name: _Optional[str] = ..., prefix: _Optional[str] = ..., glob: _Optional[str] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("dim", "shard", "range")
    DIM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    dim: int
    shard: Shard
    range: Range
    def __init__(self, dim: _Optional[int] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., range: _Optional[_Union[Range, _Mapping]] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("rank", "world")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world: int
    def __init__(self, rank: _Optional[int] = ..., world: _Optional[int] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class SelectionInfo(_message.Message):
    __slots__ = ("byte_size", "xxh3", "tensors")
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    byte_size: int
    xxh3: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, byte_size: _Optional[int] = ..., xxh3: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("header", "chunk", "up_to_date", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    UP_TO_DATE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: VersionInfo
    chunk: bytes
    up_to_date: UpToDate
    payload: Payload
    def __init__(self, header: _Optional[_Union[VersionInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ..., up_to_date: _Optional[_Union[UpToDate, _Mapping]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("direction", "accept", "fetch", "publish")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    direction: Direction
    accept: _containers.RepeatedScalarFieldContainer[Transport]
    fetch: FetchRequest
    publish: PublishHeader
    def __init__(self, direction: _Optional[_Union[Direction, str]] = ..., accept: _Optional[_Iterable[_Union[Transport, str]]] = ..., fetch: _Optional[_Union[FetchRequest, _Mapping]] = ..., publish: _Optional[_Union[PublishHeader, _Mapping]] = ...) -> None: ...

class NegotiateResponse(_message.Message):
    __slots__ = ("transport", "up_to_date", "header", "payload", "upload")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    UP_TO_DATE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    up_to_date: UpToDate
    header: VersionInfo
    payload: Payload
    upload: str
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., up_to_date: _Optional[_Union[UpToDate, _Mapping]] = ..., header: _Optional[_Union[VersionInfo, _Mapping]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., upload: _Optional[str] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("byte_size", "xxh3", "base_version", "dtype", "shared_memory", "bulk", "base_xxh3", "selection")
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    BASE_XXH3_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    byte_size: int
    xxh3: str
    base_version: int
    dtype: str
    shared_memory: SharedMemoryFile
    bulk: BulkTicket
    base_xxh3: str
    selection: SelectionInfo
    def __init__(self, byte_size: _Optional[int] = ..., xxh3: _Optional[str] = ..., base_version: _Optional[int] = ..., dtype: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemoryFile, _Mapping]] = ..., bulk: _Optional[_Union[BulkTicket, _Mapping]] = ..., base_xxh3: _Optional[str] = ..., selection: _Optional[_Union[SelectionInfo, _Mapping]] = ...) -> None: ...

class SharedMemoryFile(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class UpToDate(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("model", "since", "incoming")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    INCOMING_FIELD_NUMBER: _ClassVar[int]
    model: str
    since: int
    incoming: bool
    def __init__(self, model: _Optional[str] = ..., since: _Optional[int] = ..., incoming: _Optional[bool] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("version", "gap", "incoming")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    INCOMING_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    gap: bool
    incoming: IncomingPublish
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., gap: _Optional[bool] = ..., incoming: _Optional[_Union[IncomingPublish, _Mapping]] = ...) -> None: ...

class IncomingPublish(_message.Message):
    __slots__ = ("id", "byte_size", "failed")
    ID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    id: str
    byte_size: int
    failed: bool
    def __init__(self, id: _Optional[str] = ..., byte_size: _Optional[int] = ..., failed: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ...) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("model", "latest_version", "version_count", "retained_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_COUNT_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    latest_version: int
    version_count: int
    retained_bytes: int
    def __init__(self, model: _Optional[str] = ..., latest_version: _Optional[int] = ..., version_count: _Optional[int] = ..., retained_bytes: _Optional[int] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ...) -> None: ...

class DeleteVersionRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DeleteVersionResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: VersionInfo
    def __init__(self, deleted: _Optional[_Union[VersionInfo, _Mapping]] = ...) -> None: ...

class PinVersionRequest(_message.Message):
    __slots__ = ("model", "version", "pinned")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    pinned: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...
