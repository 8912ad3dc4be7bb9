"""WeightServiceClient: the byte-level Python client of weightserver.v1.WeightService.

Publishes and fetches safetensors bytes, lists, describes and watches versions. It needs no
torch, so the `weightserver` CLI uses it; `weightclient.WeightClient` adds tensors on top.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, TypeVar

import grpc
import xxhash

from weightclient.connection import PathLike, backoff_delay, call_metadata, open_channel, retry_unavailable
from weightclient.fetch_reports import FetchReports
from weightclient.placement import Placement, checked_views, read_file_into, recv_parts, recv_placed
from weightclient.rpc_errors import translated_rpc_errors
from weightclient.shm_directory import SharedMemoryDirectory
from weightclient.version_info import ModelSummary, VersionEvent, VersionInfo
from weightserver.config import DEFAULT_CHUNK_BYTES, DEFAULT_PORT
from weightserver.errors import IntegrityError, InvalidRequest, ServerUnavailable
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ADDRESS_ENV = "WEIGHTSERVER_ADDRESS"
TRANSPORTS = ("auto", "stream", "shm", "bulk")
BULK_CONNECT_TIMEOUT = 2.0
BULK_IDLE_TIMEOUT = 30.0
BULK_SOCKET_BUFFER = 8 << 20
BULK_RETRY_SECONDS = 60.0  # a failed bulk path (port not published, say) is retried this often
DEFAULT_ADDRESS = f"localhost:{DEFAULT_PORT}"

Buffer = bytes | bytearray | memoryview
# Called as bytes move: (bytes sent or received so far, total bytes); `done` may go back to 0
# when a fetch starts over (a retry, or a fast path falling back to the stream).
Progress = Callable[[int, int], None]
# A shared-memory payload file that was removed before it could be read: see _shm_failed.
VANISHED: Any = object()
T = TypeVar("T")
_BUFFER_TYPES = (bytes, bytearray, memoryview)


def default_address() -> str:
    """`$WEIGHTSERVER_ADDRESS`, else localhost:50051."""
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


@dataclass(frozen=True)
class FetchStats:
    """How a fetch went: which transport carried it, payload bytes moved, wall time, and
    whether it was read from the server's shared memory without asking the server first."""

    transport: str
    wire_bytes: int
    seconds: float
    direct: bool = False


@dataclass(frozen=True)
class FetchedBytes:
    """A fetched version: its description and its verified payload (a safetensors file).

    With `base_version` 0 and no `dtype` the payload is the version's own file; otherwise it
    holds only the changed tensors, or float32 tensors cast to `dtype`.
    """

    info: VersionInfo
    data: memoryview
    base_version: int = 0
    dtype: str = ""
    stats: FetchStats | None = None
    base_xxh3: str = ""  # the server's digest of the base version (deltas only)
    placed: bool = False  # the tensors went straight into the caller's views; `data` is empty


class WeightServiceClient:
    """A connection to a weight server, working on safetensors bytes.

    Args:
        address: host:port of the server; default `$WEIGHTSERVER_ADDRESS`, then localhost:50051.
        timeout: deadline in seconds for unary calls (describe, list, delete, pin).
        chunk_bytes: size of the chunks a publish sends and a fetch asks for.
        client_id: a name for this client in the server's logs (e.g. "collector-3").
        token: bearer token for servers started with --auth-tokens (default `$WEIGHTSERVER_TOKEN`).
        tls, tls_ca, tls_cert, tls_key: TLS (see `connection.open_channel`; default
            `$WEIGHTSERVER_TLS_CA` / `_CERT` / `_KEY`, plaintext when none is set).
        retry_seconds: idempotent calls (latest, describe, list, fetch, watch) retry while the
            server is unavailable, with exponential backoff and jitter, for at most the call's
            timeout, or this long when it has none. Publish, delete and pin never retry.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        client_id: str | None = None,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        retry_seconds: float = 30.0,
    ) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.retry_seconds = retry_seconds
        self._channel = open_channel(self.address, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._stub = pb_grpc.WeightServiceStub(self._channel)
        # Fetch with a deserializer that hands chunks over without a protobuf copy.
        self._fetch = self._channel.unary_stream(
            "/weightserver.v1.WeightService/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=_deserialize_fetch_response,
        )
        self._metadata = call_metadata(token, client_id)
        self._shm_usable: bool | None = None  # learned on the first shared-memory fetch
        self._bulk_usable: bool | None = None
        self._locate_usable: bool | None = None  # False: this server has no Locate, or no fast path for us
        self._bulk_retry_at = 0.0  # after a bulk failure, "auto" tries bulk again from then on
        self._bulk = _BulkConnection()
        self._shm_dirs: dict[str, SharedMemoryDirectory] = {}  # per model, once a fetch read a file there
        self._reports = FetchReports(
            lambda request: self._stub.Locate(request, timeout=self.timeout, metadata=self._metadata)
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the server has heard of every fetch read directly from its shared memory
        (they are reported in the background); False on timeout."""
        return self._reports.flush(timeout)

    def close(self) -> None:
        """Close the channel (cancels running calls) and the bulk connection."""
        self._reports.close()
        self._bulk.close()
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
        progress: Progress | None = None,
    ) -> VersionInfo:
        """Publish one safetensors file, given whole or as consecutive parts; return the version.

        `version` 0 lets the server assign latest + 1. The parts are streamed in chunks without
        being joined first. `progress(sent, total)` is called as chunks go out.
        """
        return self.publish_group_bytes(
            {model: parts},
            version=version,
            metadata=metadata,
            pin=pin,
            sha256s={model: sha256},
            timeout=timeout,
            progress=progress,
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
        progress: Progress | None = None,
    ) -> list[VersionInfo]:
        """Publish several models' safetensors files in one stream under ONE version number,
        committed together (no reader sees one model's new version beside another's old one).
        Returns each model's version, in `files` order. `progress(sent, total)` counts all models."""
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
        requests = _publish_requests(models, self.chunk_bytes, progress)
        with translated_rpc_errors(self.address):
            reply = self._stub.Publish(requests, timeout=timeout, metadata=self._metadata)
        return [VersionInfo.from_proto(v) for v in reply.versions] or [VersionInfo.from_proto(reply.version)]

    # ------------------------------------------------------------------ fetch
    def fetch_bytes(
        self,
        model: str,
        *,
        version: int | None = None,
        newer_than: int | None = None,
        base_version: int = 0,
        dtype: str = "",
        transport: str = "auto",
        timeout: float | None = None,
        into: memoryview | None = None,
        base_xxh3: str = "",
        place: Placement | None = None,
        retry: bool = True,
        progress: Progress | None = None,
    ) -> FetchedBytes | None:
        """Fetch one version's bytes: the latest, exactly `version`, or the latest only if it is
        newer than `newer_than` (None when it is not: nothing is transferred).

        `base_version` asks for a delta (only tensors that changed since that version),
        `dtype` ("BF16"/"F16") for float32 tensors cast on the server. `transport`: "auto"
        (shared memory on the same host, else bulk TCP, else the gRPC stream), "shm", "bulk"
        or "stream"; every fast path falls back to the stream. An exact `version` on the
        server's host is read from its shared memory with no call at all once a fetch of that
        model was served from there (`stats.direct`; see `shm_directory`). What arrived is checked
        against the announced size and digest (IntegrityError). `into`: a buffer for the
        stream and bulk paths to receive into when it is large enough (reused across fetches,
        it saves allocating and faulting in fresh memory each time); the result then views it.
        The shared-memory path needs none: it maps the server's file copy-on-write. `base_xxh3`: the xxh3 of the
        caller's copy of `base_version`; if the server's copy differs, the delta is refused and
        the whole version fetched instead. `place`: see `placement.Placement`; when the
        payload is the version's own file and comes over shared memory or bulk TCP, its
        tensors are received straight into the views the callable returns and verified there
        (the result is then `placed`); otherwise, or if the placed bytes fail their digests,
        the version is received normally. `retry`: while the server is unavailable, try
        again (see `retry_seconds`); False fails at once with ServerUnavailable. `progress(received,
        total)` is called as the payload's chunks arrive over the stream, once at the end over
        shared memory or bulk TCP (not for placed tensors).
        """
        options = {
            "version": version,
            "newer_than": newer_than,
            "base_version": base_version,
            "dtype": dtype,
            "transport": transport,
            "into": into,
            "base_xxh3": base_xxh3,
            "place": place,
            "progress": progress,
        }
        if not retry:
            return self._fetch_once(model, timeout=timeout, **options)
        return retry_unavailable(
            lambda remaining: self._fetch_once(model, timeout=None if timeout is None else remaining, **options),
            self._retry_window(timeout),
            self.address,
        )

    def _fetch_once(
        self,
        model: str,
        *,
        version: int | None,
        newer_than: int | None,
        base_version: int,
        dtype: str,
        transport: str,
        timeout: float | None,
        into: memoryview | None,
        base_xxh3: str,
        place: Placement | None,
        progress: Progress | None = None,
    ) -> FetchedBytes | None:
        if transport not in TRANSPORTS:
            raise InvalidRequest(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        started = time.perf_counter()
        request = _fetch_request(model, version, newer_than, self.chunk_bytes)
        request.base_version = base_version
        request.dtype = dtype
        request.accept_shared_memory = transport == "shm" or (transport == "auto" and self._shm_usable is not False)
        request.accept_bulk = transport == "bulk" or (
            transport == "auto" and (self._bulk_usable is not False or time.monotonic() >= self._bulk_retry_at)
        )
        if version is not None and request.accept_shared_memory and not base_version and not dtype:
            direct = self._read_directly(request, started, into, place, progress)
            if direct is not None:
                return direct
        with translated_rpc_errors(self.address):
            located = self._locate(request, timeout) if self._may_locate(request) else None
            if located is not None and located.HasField("up_to_date"):
                return None
            if located is not None and located.HasField("payload"):
                self._locate_usable = True
                info = VersionInfo.from_proto(located.header)
                fetched = self._receive_payload(info, located.payload, iter(()), started, into, place, progress)
            else:
                if located is not None:  # no fast path for this client: Fetch from now on
                    self._locate_usable = False
                streamed = self._fetch_streamed(request, started, into, place, progress, timeout)
                if streamed is None or isinstance(streamed, FetchedBytes):
                    return streamed  # up to date, or a plain stream
                info, fetched = streamed
        if fetched is None or fetched is VANISHED:
            # None: the fast path failed, so the same payload comes over the gRPC stream.
            # VANISHED: the shared-memory file was evicted after the reply, so ask again for what
            # the caller asked for (the latest, or that version: NOT_FOUND if it is gone).
            if fetched is VANISHED:
                log.info("%s v%d left shared memory while being fetched; asking again", model, info.version)
            asked = (version, newer_than) if fetched is VANISHED else (info.version, None)
            return self._fetch_once(
                model,
                version=asked[0],
                newer_than=asked[1],
                base_version=base_version,
                dtype=dtype,
                transport="stream",
                timeout=timeout,
                into=into,
                base_xxh3=base_xxh3,
                place=None,
                progress=progress,
            )
        stale_base = bool(fetched and fetched.base_version and base_xxh3 and fetched.base_xxh3 != base_xxh3)
        if stale_base:
            log.info("%s v%d on the server differs from the caller's; fetching it whole", model, base_version)
            return self.fetch_bytes(
                model,
                version=info.version,
                dtype=dtype,
                transport=transport,
                timeout=timeout,
                into=into,
                retry=False,
                progress=progress,
            )
        return fetched

    def _read_directly(
        self,
        request: pb.FetchRequest,
        started: float,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
    ) -> FetchedBytes | None:
        """An exact version read from the server's shared memory by its header file, with no
        round trip (the server hears of it afterwards, see FetchReports); None to ask the
        server instead: no folder learned yet, no header (the version is not there), or a
        file that cannot be read or fails its digests."""
        folder = self._shm_dirs.get(request.model)
        if folder is None or self._shm_usable is False:
            return None
        header = folder.header(request.model, request.version)
        if header is None:
            return None
        info = VersionInfo.from_proto(header)
        payload = pb.Payload(
            byte_size=info.byte_size,
            xxh3=info.xxh3,
            shared_memory=pb.SharedMemoryFile(path=folder.file(request.version)),
        )
        fetched = self._receive_payload(info, payload, iter(()), started, into, place, progress)
        if fetched is None or fetched is VANISHED:
            return None
        self._reports.report(request)
        return replace(fetched, stats=replace(fetched.stats, direct=True))

    def _learned_shm_file(self, model: str, version: int, path: str) -> None:
        """A whole version came from `path`: remember its folder for direct reads."""
        folder = SharedMemoryDirectory.learned_from(path, version)
        if folder is not None:
            self._shm_dirs[model] = folder

    def _may_locate(self, request: pb.FetchRequest) -> bool:
        """Whether to ask with Locate (one unary round trip) rather than a Fetch stream: the
        request accepts a fast path and this server has answered Locate with one so far."""
        return self._locate_usable is not False and (request.accept_shared_memory or request.accept_bulk)

    def _locate(self, request: pb.FetchRequest, timeout: float | None) -> pb.LocateResponse | None:
        """Locate's reply, or None for a server that predates it (Fetch from now on)."""
        try:
            return self._stub.Locate(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._locate_usable = False
            return None

    def _fetch_streamed(
        self,
        request: pb.FetchRequest,
        started: float,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
        timeout: float | None,
    ) -> FetchedBytes | tuple[VersionInfo, Any] | None:
        """One Fetch stream: None when up to date, FetchedBytes for a plain stream (no payload
        message), else the header and what `_receive_payload` made of the payload."""
        model = request.model
        stream = self._fetch(request, timeout=timeout, metadata=self._metadata)
        try:
            first = next(stream, None)
            if isinstance(first, memoryview) or first is None:
                raise IntegrityError(f"model {model!r}: the fetch stream did not start with a header")
            kind = first.WhichOneof("kind")
            if kind == "up_to_date":
                _expect_end(stream, model)
                return None
            if kind != "header":
                raise IntegrityError(f"model {model!r}: fetch stream started with {kind!r}, expected a header")
            info = VersionInfo.from_proto(first.header)
            wants_payload = request.base_version or request.dtype or request.accept_shared_memory or request.accept_bulk
            if not wants_payload:
                data = _receive_into(info.byte_size, stream, f"{info.model!r} v{info.version}", into, progress)
                _check_digests(data, info, xxh3=info.xxh3, sha256=info.sha256)
                return FetchedBytes(info, data, stats=FetchStats("stream", len(data), time.perf_counter() - started))
            second = next(stream, None)
            if isinstance(second, pb.FetchResponse) and second.WhichOneof("kind") == "payload":
                payload = second.payload
            else:
                raise IntegrityError(f"model {model!r}: expected a payload description after the header")
            fetched = self._receive_payload(info, payload, stream, started, into, place, progress)
            if payload.HasField("shared_memory") or payload.HasField("bulk"):
                # The bytes came another way. The server's end of stream arrived while they
                # moved, so reading it now costs no round trip.
                _expect_end(stream, model)
            return info, fetched
        finally:
            stream.cancel()

    def _receive_payload(
        self,
        info: VersionInfo,
        payload: pb.Payload,
        stream: Iterator[Any],
        started: float,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None = None,
    ) -> FetchedBytes | None:
        label = f"{info.model!r} v{info.version}"
        whole_file = not payload.base_version and not payload.dtype and payload.xxh3 == info.xxh3
        fast = payload.HasField("shared_memory") or payload.HasField("bulk")
        views = checked_views(place, info) if place is not None and whole_file and fast else None
        if views is not None:
            return self._receive_placed(info, payload, started, views)
        if payload.HasField("shared_memory"):
            data = _map_shared_memory(payload.shared_memory.path, payload.byte_size)
            transport = "shm"
            if data is None or xxhash.xxh3_128_hexdigest(data) != payload.xxh3:
                return self._shm_failed(payload.shared_memory.path)
            self._shm_usable = True
            if whole_file:
                self._learned_shm_file(info.model, info.version, payload.shared_memory.path)
        elif payload.HasField("bulk"):
            transport = "bulk"
            try:
                data = self._bulk.receive(
                    _host_of(self.address), payload.bulk.port, payload.bulk.ticket, payload.byte_size, into
                )
            except (OSError, EOFError) as exc:
                self._bulk_usable = False
                self._bulk_retry_at = time.monotonic() + BULK_RETRY_SECONDS
                log.warning("bulk transfer of %s from port %d failed (%s); falling back", label, payload.bulk.port, exc)
                return None
            self._bulk_usable = True
            _check_digests(data, info, xxh3=payload.xxh3, label=label + " payload")
        else:
            transport = "stream"
            data = _receive_into(payload.byte_size, stream, label, into, progress)
            _check_digests(data, info, xxh3=payload.xxh3, label=label + " payload")
        if progress is not None and transport != "stream":
            progress(len(data), len(data))
        stats = FetchStats(transport, len(data), time.perf_counter() - started)
        return FetchedBytes(
            info, data, base_version=payload.base_version, dtype=payload.dtype, stats=stats, base_xxh3=payload.base_xxh3
        )

    # ------------------------------------------------------------------ watch
    def _shm_failed(self, path: str) -> FetchedBytes | None:
        """A shared-memory payload that could not be used: None to fall back to the stream and
        stop asking (another host, or a damaged file), or VANISHED when the file is gone from a
        directory this client can see (the version was evicted after the reply)."""
        if not os.path.exists(path) and os.path.isdir(os.path.dirname(path)):
            return VANISHED
        self._shm_usable = False
        log.info("shared-memory payload %s unusable here; falling back", path)
        return None

    def _receive_placed(
        self, info: VersionInfo, payload: pb.Payload, started: float, views: Mapping[str, memoryview]
    ) -> FetchedBytes | None:
        """The version scattered into `views` over shared memory or bulk TCP and verified, or
        None to fetch it again over the stream."""
        label = f"{info.model!r} v{info.version}"
        if payload.HasField("shared_memory"):
            transport = "shm"
            bad = read_file_into(payload.shared_memory.path, info, views)
            if bad is None:
                return self._shm_failed(payload.shared_memory.path)
        else:
            transport = "bulk"
            try:
                bad = self._bulk.receive_placed(
                    _host_of(self.address), payload.bulk.port, payload.bulk.ticket, info, views
                )
            except (OSError, EOFError) as exc:
                self._bulk_usable = False
                self._bulk_retry_at = time.monotonic() + BULK_RETRY_SECONDS
                log.warning("bulk transfer of %s from port %d failed (%s); falling back", label, payload.bulk.port, exc)
                return None
        if bad:
            if transport == "shm":
                self._shm_usable = False  # a stale or altered file: stop asking for it
            log.warning("%s: placed tensors %s do not match their digests; fetching again", label, bad[:5])
            return None
        if transport == "shm":
            self._shm_usable = True
            self._learned_shm_file(info.model, info.version, payload.shared_memory.path)
        else:
            self._bulk_usable = True
        stats = FetchStats(transport, payload.byte_size, time.perf_counter() - started)
        return FetchedBytes(info, memoryview(b""), stats=stats, placed=True)

    def watch(self, model: str, *, since: int = 0, timeout: float | None = None) -> Iterator[VersionEvent]:
        """Yield an event for every version of `model` committed after `since`, in order.

        Versions that landed before the call but after `since` (and are still retained) come
        first. The iterator runs until closed, the deadline passes, or the server stops.
        """
        if since < 0:
            raise InvalidRequest(f"since must be >= 0 (a version number, 0 for all retained), got {since}")
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor, failures, outage_began = since, 0, 0.0
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            request = pb.WatchRequest(model=model, since=cursor)
            stream = self._stub.Watch(request, timeout=remaining, metadata=self._metadata)
            try:
                with translated_rpc_errors(self.address):
                    for event in stream:
                        failures = 0
                        cursor = max(cursor, event.version.version)
                        yield VersionEvent(VersionInfo.from_proto(event.version), gap=event.gap)
                return
            except ServerUnavailable:
                # The server went away (restart, network): subscribe again from the last
                # version seen, so that nothing is missed or repeated.
                now = time.monotonic()
                outage_began = now if failures == 0 else outage_began
                if now - outage_began >= self._retry_window(remaining):
                    raise
                if failures == 0:
                    log.warning("watch of %r at %s interrupted after v%d; resubscribing", model, self.address, cursor)
                time.sleep(backoff_delay(failures))
                failures += 1
            finally:
                stream.cancel()

    # ------------------------------------------------------------------ describe and admin
    def latest(self, model: str, *, retry: bool = True) -> VersionInfo:
        """Describe the newest version of `model` (ModelNotFound if it has none). `retry=False`
        raises ServerUnavailable at once instead of waiting for the server to come back."""
        request = pb.GetLatestRequest(model=model)
        return VersionInfo.from_proto(self._call(self._stub.GetLatest, request, retry=retry))

    def describe(self, model: str, version: int = 0) -> VersionInfo:
        """Describe `version` of `model` (0: the latest)."""
        return VersionInfo.from_proto(self._call(self._stub.Describe, pb.DescribeRequest(model=model, version=version)))

    def list_models(self) -> list[ModelSummary]:
        """Every model on the server, sorted by name."""
        reply = self._call(self._stub.ListModels, pb.ListModelsRequest())
        return [ModelSummary.from_proto(m) for m in reply.models]

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Retained versions of `model`, oldest first."""
        reply = self._call(self._stub.ListVersions, pb.ListVersionsRequest(model=model))
        return [VersionInfo.from_proto(v) for v in reply.versions]

    def delete(self, model: str, version: int) -> VersionInfo:
        """Delete one version from the server (and its data dir)."""
        reply = self._call(self._stub.DeleteVersion, pb.DeleteVersionRequest(model=model, version=version), retry=False)
        return VersionInfo.from_proto(reply.deleted)

    def pin(self, model: str, version: int, pinned: bool = True) -> VersionInfo:
        """Pin (keep beyond --keep) or unpin a version."""
        request = pb.PinVersionRequest(model=model, version=version, pinned=pinned)
        return VersionInfo.from_proto(self._call(self._stub.PinVersion, request, retry=False))

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object, *, retry: bool = True) -> Any:
        def once(timeout: float | None) -> Any:
            with translated_rpc_errors(self.address):
                return method(request, timeout=timeout, metadata=self._metadata)

        if not retry:
            return once(self.timeout)
        return retry_unavailable(once, self._retry_window(self.timeout), self.address)

    def _retry_window(self, timeout: float | None) -> float:
        return timeout if timeout is not None else self.retry_seconds


def _expect_end(stream: Iterator[Any], model: str) -> None:
    """Read a Fetch stream to its end (the OK status the server sent after its last message).
    Cancelling it instead races with that status and makes grpc log an error on the server."""
    for _ in stream:
        raise IntegrityError(f"model {model!r}: the server sent more than the fetch expects")


def _sha256(views: Iterable[memoryview]) -> str:
    hasher = hashlib.sha256()
    for view in views:
        hasher.update(view)
    return hasher.hexdigest()


def _publish_requests(
    models: Sequence[tuple[pb.PublishHeader, Iterable[memoryview]]], chunk_bytes: int, progress: Progress | None = None
) -> Iterator[pb.PublishRequest]:
    """Each header followed by its parts re-cut into chunks of `chunk_bytes` (small parts are
    merged), then the commit. `progress` hears of each chunk once gRPC has taken it."""
    total = sum(header.total_bytes for header, _ in models)
    sent = 0
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
                    sent += pending_bytes
                    if progress is not None:
                        progress(sent, total)
                    pending, pending_bytes = [], 0
        if pending:
            yield pb.PublishRequest(chunk=b"".join(pending))
            sent += pending_bytes
            if progress is not None:
                progress(sent, total)
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


def new_buffer(size: int, into: memoryview | None = None) -> memoryview:
    """`into[:size]` if it is large enough, else a writable, uninitialised byte buffer. Unlike
    bytearray(size) it is not zero-filled first, which for a large model costs as much as
    receiving it."""
    if into is not None and into.nbytes >= size and not into.readonly:
        return into.cast("B")[:size]
    import numpy as np

    return memoryview(np.empty(size, dtype=np.uint8))


def _receive_into(
    size: int, stream: Iterable[Any], label: str, into: memoryview | None = None, progress: Progress | None = None
) -> memoryview:
    """Receive the chunks into one buffer of the announced size."""
    buffer = new_buffer(size, into)
    received = 0
    for message in stream:
        chunk = message if isinstance(message, memoryview) else message.chunk
        end = received + len(chunk)
        if end > size:
            raise IntegrityError(f"model {label}: server sent more than the announced {size} bytes")
        buffer[received:end] = chunk
        received = end
        if progress is not None:
            progress(received, size)
    if received != size:
        raise IntegrityError(f"model {label}: received {received} of {size} bytes; the stream was cut short")
    return buffer


def _check_digests(
    data: memoryview, info: VersionInfo, *, xxh3: str = "", sha256: str = "", label: str | None = None
) -> None:
    """xxh3-128 when the server announced one (20x cheaper), else sha256."""
    label = label or f"{info.model!r} v{info.version}"
    if xxh3:
        digest, expected, name = xxhash.xxh3_128_hexdigest(data), xxh3, "xxh3"
    else:
        digest, expected, name = hashlib.sha256(data).hexdigest(), sha256, "sha256"
    if digest != expected:
        raise IntegrityError(f"model {label}: {name} of the received bytes is {digest}, server announced {expected}")


def _map_shared_memory(path: str, size: int) -> memoryview | None:
    """The file mapped copy-on-write (reading it costs no copy; a write to a tensor viewing it
    stays private), or None if it cannot be opened here (another host) or has another size.

    The mapping stays valid after the server removes the file."""
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != size:
                return None
            if size == 0:
                return memoryview(bytearray())
            mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return memoryview(mapping)
    except (OSError, ValueError):
        return None


class _BulkConnection:
    """A client's kept-open connection to a server's bulk port (one transfer at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._target: tuple[str, int] | None = None

    def receive(self, host: str, port: int, ticket: bytes, size: int, into: memoryview | None) -> memoryview:
        """The payload behind `ticket`, received into `into` when it is large enough."""
        buffer = new_buffer(size, into)
        self._transfer(host, port, ticket, lambda conn: recv_parts(conn, [buffer]))
        return buffer

    def receive_placed(
        self, host: str, port: int, ticket: bytes, info: VersionInfo, views: Mapping[str, memoryview]
    ) -> list[str]:
        """The version file behind `ticket`, scattered into `views` (see placement.py); the
        names of placed tensors that fail their digests."""
        return self._transfer(host, port, ticket, lambda conn: recv_placed(conn, info, views))

    def _transfer(self, host: str, port: int, ticket: bytes, read: Callable[[socket.socket], T]) -> T:
        with self._lock:
            fresh = self._socket is None or self._target != (host, port)
            try:
                return self._send_ticket(host, port, ticket, read)
            except (OSError, EOFError):
                self.close()
                if fresh:
                    raise
            # A kept connection the server closed meanwhile: the ticket is unused, try afresh.
            return self._send_ticket(host, port, ticket, read)

    def _send_ticket(self, host: str, port: int, ticket: bytes, read: Callable[[socket.socket], T]) -> T:
        if self._socket is None or self._target != (host, port):
            self.close()
            self._socket = _connect_bulk(host, port)
            self._target = (host, port)
        self._socket.sendall(ticket)
        return read(self._socket)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _connect_bulk(host: str, port: int) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
    conn = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A large receive buffer from the first byte: a fresh connection's window otherwise
        # grows from ~128 KiB, which dominates a transfer of a few MiB.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BULK_SOCKET_BUFFER)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(BULK_CONNECT_TIMEOUT)
        conn.connect(address)
        conn.settimeout(BULK_IDLE_TIMEOUT)
    except OSError:
        conn.close()
        raise
    return conn


def _host_of(address: str) -> str:
    """The host part of a gRPC target: 'localhost:50051' -> 'localhost', '[::1]:5' -> '::1'."""
    target = address.split("///", 1)[-1]
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host.strip("[]")


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _deserialize_fetch_response(raw: bytes) -> pb.FetchResponse | memoryview:
    """Chunk messages become a view of their bytes (no protobuf copy); others parse normally."""
    if raw[:1] == b"\x12":
        length, position = _read_varint(raw, 1)
        if position + length == len(raw):
            return memoryview(raw)[position:]
    return pb.FetchResponse.FromString(raw)
