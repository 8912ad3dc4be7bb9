"""WeightServiceClient: the byte-level Python client of weightserver.v1.WeightService.

Publishes and fetches safetensors bytes, lists, describes and watches versions. It needs no
torch, so the `weightserver` CLI uses it; `weightclient.WeightClient` adds tensors on top.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc

from weightclient.rpc_errors import translated_rpc_errors
from weightclient.version_info import ModelSummary, VersionEvent, VersionInfo
from weightserver.config import DEFAULT_CHUNK_BYTES, DEFAULT_PORT, MAX_MESSAGE_BYTES
from weightserver.errors import IntegrityError, InvalidRequest
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

ADDRESS_ENV = "WEIGHTSERVER_ADDRESS"
DEFAULT_ADDRESS = f"localhost:{DEFAULT_PORT}"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

Buffer = bytes | bytearray | memoryview
_BUFFER_TYPES = (bytes, bytearray, memoryview)


def default_address() -> str:
    """`$WEIGHTSERVER_ADDRESS`, else localhost:50051."""
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


@dataclass(frozen=True)
class FetchedBytes:
    """A fetched version: its description and its verified safetensors bytes."""

    info: VersionInfo
    data: bytearray


class WeightServiceClient:
    """A connection to a weight server, working on safetensors bytes.

    Args:
        address: host:port of the server; default `$WEIGHTSERVER_ADDRESS`, then localhost:50051.
        timeout: deadline in seconds for unary calls (describe, list, delete, pin).
        chunk_bytes: size of the chunks a publish sends and a fetch asks for.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.WeightServiceStub(self._channel)

    def close(self) -> None:
        """Close the channel; cancels running calls."""
        self._channel.close()

    def __enter__(self) -> WeightServiceClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r})"

    # ------------------------------------------------------------------ publish
    def publish_bytes(
        self,
        model: str,
        parts: Buffer | Sequence[Buffer],
        *,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        sha256: str | None = None,
        timeout: float | None = None,
    ) -> VersionInfo:
        """Publish one safetensors file, given whole or as consecutive parts; return the version.

        `version` 0 lets the server assign latest + 1. The parts are streamed in chunks without
        being joined first.
        """
        return self.publish_group_bytes(
            {model: parts}, version=version, metadata=metadata, pin=pin, sha256s={model: sha256}, timeout=timeout
        )[0]

    def publish_group_bytes(
        self,
        files: Mapping[str, Buffer | Sequence[Buffer]],
        *,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        sha256s: Mapping[str, str | None] | None = None,
        timeout: float | None = None,
    ) -> list[VersionInfo]:
        """Publish several models' safetensors files in one stream under ONE version number,
        committed together (no reader sees one model's new version beside another's old one).
        Returns each model's version, in `files` order."""
        if not files:
            raise InvalidRequest("publish needs at least one model")
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        models = []
        for i, (model, parts) in enumerate(files.items()):
            views = [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, _BUFFER_TYPES) else parts)]
            digest = (sha256s or {}).get(model) or _sha256(views)
            header = pb.PublishHeader(
                model=model,
                version=version if i == 0 else 0,
                metadata=meta,
                total_bytes=sum(v.nbytes for v in views),
                sha256=digest,
                pin=pin,
            )
            models.append((header, views))
        requests = _publish_requests(models, self.chunk_bytes)
        with translated_rpc_errors(self.address):
            reply = self._stub.Publish(requests, timeout=timeout)
        return [VersionInfo.from_proto(v) for v in reply.versions] or [VersionInfo.from_proto(reply.version)]

    # ------------------------------------------------------------------ fetch
    def fetch_bytes(
        self,
        model: str,
        *,
        version: int | None = None,
        newer_than: int | None = None,
        timeout: float | None = None,
    ) -> FetchedBytes | None:
        """Fetch one version's bytes: the latest, exactly `version`, or the latest only if it is
        newer than `newer_than` (None when it is not: nothing is transferred).

        The size and sha256 of what arrived are checked against the header (IntegrityError).
        """
        request = _fetch_request(model, version, newer_than, self.chunk_bytes)
        with translated_rpc_errors(self.address):
            stream = self._stub.Fetch(request, timeout=timeout)
            try:
                first = next(stream, None)
                if first is None:
                    raise IntegrityError(f"model {model!r}: the server ended the fetch without a header")
                kind = first.WhichOneof("kind")
                if kind == "up_to_date":
                    return None
                if kind != "header":
                    raise IntegrityError(f"model {model!r}: fetch stream started with {kind!r}, expected a header")
                info = VersionInfo.from_proto(first.header)
                data = _receive_into(info, stream)
            finally:
                stream.cancel()
        return FetchedBytes(info, data)

    # ------------------------------------------------------------------ watch
    def watch(self, model: str, *, since: int = 0, timeout: float | None = None) -> Iterator[VersionEvent]:
        """Yield an event for every version of `model` committed after `since`, in order.

        Versions that landed before the call but after `since` (and are still retained) come
        first. The iterator runs until closed, the deadline passes, or the server stops.
        """
        request = pb.WatchRequest(model=model, since=since)
        with translated_rpc_errors(self.address):
            stream = self._stub.Watch(request, timeout=timeout)
            try:
                for event in stream:
                    yield VersionEvent(VersionInfo.from_proto(event.version), gap=event.gap)
            finally:
                stream.cancel()

    # ------------------------------------------------------------------ describe and admin
    def latest(self, model: str) -> VersionInfo:
        """Describe the newest version of `model` (ModelNotFound if it has none)."""
        return self._unary(self._stub.GetLatest, pb.GetLatestRequest(model=model))

    def describe(self, model: str, version: int = 0) -> VersionInfo:
        """Describe `version` of `model` (0: the latest)."""
        return self._unary(self._stub.Describe, pb.DescribeRequest(model=model, version=version))

    def list_models(self) -> list[ModelSummary]:
        """Every model on the server, sorted by name."""
        with translated_rpc_errors(self.address):
            reply = self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout)
        return [ModelSummary.from_proto(m) for m in reply.models]

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Retained versions of `model`, oldest first."""
        with translated_rpc_errors(self.address):
            reply = self._stub.ListVersions(pb.ListVersionsRequest(model=model), timeout=self.timeout)
        return [VersionInfo.from_proto(v) for v in reply.versions]

    def delete(self, model: str, version: int) -> VersionInfo:
        """Delete one version from the server (and its data dir)."""
        with translated_rpc_errors(self.address):
            reply = self._stub.DeleteVersion(
                pb.DeleteVersionRequest(model=model, version=version), timeout=self.timeout
            )
        return VersionInfo.from_proto(reply.deleted)

    def pin(self, model: str, version: int, pinned: bool = True) -> VersionInfo:
        """Pin (keep beyond --keep) or unpin a version."""
        return self._unary(self._stub.PinVersion, pb.PinVersionRequest(model=model, version=version, pinned=pinned))

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> VersionInfo:
        with translated_rpc_errors(self.address):
            reply = method(request, timeout=self.timeout)
        return VersionInfo.from_proto(reply)


def _sha256(views: Iterable[memoryview]) -> str:
    hasher = hashlib.sha256()
    for view in views:
        hasher.update(view)
    return hasher.hexdigest()


def _publish_requests(
    models: Iterable[tuple[pb.PublishHeader, Iterable[memoryview]]], chunk_bytes: int
) -> Iterator[pb.PublishRequest]:
    """Each header followed by its parts re-cut into chunks of `chunk_bytes` (small parts are
    merged), then the commit."""
    for header, views in models:
        yield pb.PublishRequest(header=header)
        pending: list[memoryview] = []
        pending_bytes = 0
        for view in views:
            while view.nbytes:
                take = min(chunk_bytes - pending_bytes, view.nbytes)
                pending.append(view[:take])
                pending_bytes += take
                view = view[take:]
                if pending_bytes == chunk_bytes:
                    yield pb.PublishRequest(chunk=b"".join(pending))
                    pending, pending_bytes = [], 0
        if pending:
            yield pb.PublishRequest(chunk=b"".join(pending))
    yield pb.PublishRequest(commit=pb.PublishCommit())


def _fetch_request(model: str, version: int | None, newer_than: int | None, chunk_bytes: int) -> pb.FetchRequest:
    if version is not None and newer_than is not None:
        raise InvalidRequest("give at most one of version= and newer_than=")
    if version is not None:
        if version < 1:
            raise InvalidRequest(f"version must be >= 1, got {version}")
        return pb.FetchRequest(model=model, version=version, chunk_size=chunk_bytes)
    if newer_than is not None:
        if newer_than < 0:
            raise InvalidRequest(f"newer_than must be >= 0, got {newer_than}")
        return pb.FetchRequest(model=model, newer_than=newer_than, chunk_size=chunk_bytes)
    return pb.FetchRequest(model=model, chunk_size=chunk_bytes)


def _receive_into(info: VersionInfo, stream: Iterable[pb.FetchResponse]) -> bytearray:
    """Receive the chunks into one buffer of the announced size; check size and sha256."""
    buffer = bytearray(info.byte_size)
    hasher = hashlib.sha256()
    received = 0
    for message in stream:
        chunk = message.chunk
        end = received + len(chunk)
        if end > info.byte_size:
            raise IntegrityError(
                f"model {info.model!r} v{info.version}: server sent more than the announced {info.byte_size} bytes"
            )
        buffer[received:end] = chunk
        hasher.update(chunk)
        received = end
    if received != info.byte_size:
        raise IntegrityError(
            f"model {info.model!r} v{info.version}: received {received} of {info.byte_size} bytes; "
            "the stream was cut short"
        )
    digest = hasher.hexdigest()
    if digest != info.sha256:
        raise IntegrityError(
            f"model {info.model!r} v{info.version}: sha256 of the received bytes is {digest}, "
            f"server announced {info.sha256}"
        )
    return buffer
