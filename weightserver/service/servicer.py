"""WeightServicer: weightserver.v1.WeightService on grpc.aio, one short method per RPC."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from weightserver.config import ServerConfig
from weightserver.metrics import NoMetrics
from weightserver.protocol import deltas
from weightserver.protocol.digests import sha256_hex
from weightserver.protocol.errors import InvalidRequest, PermissionDenied, WeightServerError, clipped_repr
from weightserver.protocol.limits import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from weightserver.protocol.selection import Resolved, Selection
from weightserver.protocol.version_info import selection_message, summary_message, version_message
from weightserver.publish.call import PublishCall, Publishes
from weightserver.publish.incoming import IncomingPublishes
from weightserver.publish.priority import CommitsFirst
from weightserver.publish.staged_uploads import StagedUploads
from weightserver.service.auth import TokenTable
from weightserver.service.calls import Context, Undecodable, client_id_of, log_event, streaming, unary
from weightserver.service.watch import Watches
from weightserver.storage.payloads import CAST_TARGETS, Payload, PayloadCache
from weightserver.storage.store import Commit, Version, VersionStore
from weightserver.transports.base import ServerTransport
from weightserver.transports.bulk import BulkEndpoint, BulkTransport
from weightserver.transports.shared_memory import SharedMemoryFiles, SharedMemoryTransport
from weightserver.transports.stream import StreamTransport
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from weightserver.relay.relay import Relay


class WeightServicer(pb_grpc.WeightServiceServicer):
    def __init__(
        self,
        store: VersionStore,
        config: ServerConfig,
        *,
        bulk: BulkEndpoint | None = None,
        shared_memory: SharedMemoryFiles | None = None,
        tokens: TokenTable | None = None,
        metrics: NoMetrics | None = None,
    ) -> None:
        self.store, self.tokens, self.config = store, tokens, config
        self.payloads = PayloadCache(config.payload_cache_bytes)
        self.metrics = metrics or NoMetrics()
        self.relay: Relay | None = None  # on a relay: refuses changes, names its primary to watchers
        self.commits_first = CommitsFirst()
        self.incoming = IncomingPublishes()  # publishes whose bytes are arriving, for cut-through
        self.staged = StagedUploads(store.header_limits, self.incoming, shared_memory)
        self.publishes = Publishes(store, shared_memory, self.incoming, self.staged, config.publish_timeout)
        self.watches = Watches(
            store, self.incoming, self.metrics, lambda: self.relay.watch_metadata() if self.relay else ()
        )
        self.stream = StreamTransport(config.max_stream_fetches, self.commits_first)
        self.shared_memory = SharedMemoryTransport(shared_memory, self.staged, store) if shared_memory else None
        offered = [self.shared_memory, BulkTransport(bulk, self.staged) if bulk else None]
        self.transports: dict[int, ServerTransport] = {t.kind: t for t in offered if t is not None}
        store.subscribe(self._on_commit)
        for summary in store.models():  # versions loaded from a data dir
            self.metrics.retained(summary.model, store.versions(summary.model))

    def close(self) -> None:
        self.publishes.close()
        self.staged.close()

    def authorize(self, context: Context, method: str, model: str | None = None) -> bytes | None:
        """The caller's token's sha256 (None: no tokens), which owns the uploads it stages; raises if it may not."""
        return self.tokens.authorize(context.invocation_metadata(), method, model).token_sha256 if self.tokens else None

    def _authorize_header(self, context: Context, header: pb.PublishHeader) -> bytes | None:
        owner = self.authorize(context, "Publish", header.model)
        try:
            if header.pin:
                self.authorize(context, "PinVersion", header.model)
        except PermissionDenied as exc:
            raise PermissionDenied(f"a publish with pin=True pins the version: {exc}") from None
        return owner

    def _on_commit(self, commit: Commit) -> None:
        """A commit may have evicted versions; an xxh3-only one's shm header is rewritten with its sha256."""
        for record in commit.versions:
            self.forget_removed(record.model)
            if not record.sha256 and self.shared_memory is not None:
                self.store.sha256_of(record, hurry=False).add_done_callback(
                    functools.partial(_rewrite_header, self.shared_memory, record.model, record.version)
                )

    def forget_removed(self, model: str) -> None:
        """Drop payloads and files of versions no longer retained; update the metrics."""
        try:
            versions = self.store.versions(model)
        except WeightServerError:
            versions = []
        self.metrics.retained(model, versions)
        files = self.shared_memory.files if self.shared_memory is not None else None
        keys = [*self.payloads.keys(), *(files.keys() if files is not None else ())]
        derived = {v for m, version, base, *_ in keys if m == model for v in (version, base) if v}
        for version in derived - {v.version for v in versions}:
            self.payloads.forget(model, version)
            if files is not None:
                files.forget(model, version)

    @unary
    async def Publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context: Context) -> pb.PublishResponse:
        started, owner = time.perf_counter(), self.authorize(context, "Publish")
        # Whose bucket of waiting hold the publish draws on: its token's, or its host's.
        bucket = f"token {owner.hex()}" if owner is not None else "peer " + context.peer().rpartition(":")[0]

        def counted(record: Version) -> None:  # in the commit: who sees the version finds it counted
            self.metrics.published(record.model, record.byte_size, time.perf_counter() - started)

        with self.commits_first.publish(bucket) as turn:
            call = PublishCall(self.publishes, turn, owner, counted)
            await call.run(self._checked_headers(request_iterator, context))
        phases = {f"{phase}_ms": round(getattr(call, phase) * 1e3, 3) for phase in ("receive", "verify", "commit")}
        for model, record in zip(call.models, call.records, strict=True):
            if call.repeat:
                log_event("publish_repeat", context, model=record.model, version=record.version)
            else:
                self._transferred("publish", record, started, context, model.transport, **phases)
        infos = [version_message(r) for r in call.records]
        return pb.PublishResponse(version=infos[0], versions=infos)

    async def _checked_headers(
        self, messages: AsyncIterator[pb.PublishRequest], context: Context
    ) -> AsyncIterator[pb.PublishRequest]:
        async for message in messages:
            if isinstance(message, Undecodable):
                raise message.error()
            if message.WhichOneof("kind") == "header":
                self._authorize_header(context, message.header)
            yield message

    @unary
    async def GetLatest(self, request: pb.GetLatestRequest, context: Context) -> pb.VersionInfo:
        return version_message(self.store.latest(request.model))

    @unary
    async def Describe(self, request: pb.DescribeRequest, context: Context) -> pb.VersionInfo:
        record = self.store.get(request.model, request.version) if request.version else self.store.latest(request.model)
        return version_message(record)

    @unary
    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[summary_message(m) for m in self.store.models()])

    @unary
    async def ListVersions(self, request: pb.ListVersionsRequest, context: Context) -> pb.ListVersionsResponse:
        return pb.ListVersionsResponse(versions=[version_message(v) for v in self.store.versions(request.model)])

    @unary
    async def DeleteVersion(self, request: pb.DeleteVersionRequest, context: Context) -> pb.DeleteVersionResponse:
        record = await asyncio.to_thread(self.store.delete, request.model, request.version)
        self.forget_removed(record.model)
        log_event("delete", context, model=record.model, version=record.version)
        return pb.DeleteVersionResponse(deleted=version_message(record))

    @unary
    async def PinVersion(self, request: pb.PinVersionRequest, context: Context) -> pb.VersionInfo:
        record = await asyncio.to_thread(self.store.set_pinned, request.model, request.version, request.pinned)
        self.forget_removed(record.model)
        if self.shared_memory is not None:
            await asyncio.to_thread(self.shared_memory.write_header, record.model, record.version)
        log_event("pin" if record.pinned else "unpin", context, model=record.model, version=record.version)
        return version_message(record)

    @streaming
    async def Fetch(self, request: pb.FetchRequest, context: Context) -> AsyncIterator[pb.FetchResponse | bytes]:
        started, asked = time.perf_counter(), request.chunk_size  # (0: the server's default)
        chunk_bytes = max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, asked)) if asked > 0 else self.config.chunk_bytes
        if request.WhichOneof("selector") == "incoming":  # a publish's bytes as they land
            announced = self.incoming.get(request.incoming, request.model)
            yield pb.FetchResponse(payload=pb.Payload(byte_size=announced.byte_size))
            async with contextlib.aclosing(self.stream.send_incoming(announced, chunk_bytes)) as chunks:
                async for message in chunks:
                    yield message
            fields = {"model": announced.model, "bytes": announced.byte_size, "transport": "stream"}
            log_event("fetch_incoming", context, **fields, duration_ms=round((time.perf_counter() - started) * 1e3, 3))
            return
        record = self._chosen(request)
        if record is None:
            yield pb.FetchResponse(up_to_date=pb.UpToDate(latest_version=request.newer_than))
            return
        selection, header = _resolved(record, request), version_message(record)  # (a bad selection: nothing sent)
        if not header.sha256:  # published with only an xxh3: the store computes it (here, if the version went first)
            try:
                header.sha256 = await asyncio.wrap_future(self.store.sha256_of(record))
            except WeightServerError:
                header.sha256 = await asyncio.to_thread(sha256_hex, record.data)
        yield pb.FetchResponse(header=header)
        payload, description = await self._payload_for(record, request, selection)
        if request.base_version or request.dtype or selection is not None:
            yield pb.FetchResponse(payload=description)
        async with contextlib.aclosing(self.stream.send(payload.parts, chunk_bytes)) as chunks:
            async for message in chunks:
                yield message
        self._transferred("fetch", record, started, context, "stream", sent=payload.byte_size)

    @unary
    async def Negotiate(self, request: pb.NegotiateRequest, context: Context) -> pb.NegotiateResponse:
        """The first transport the caller accepts (in its order) that makes an offer, else the stream."""
        answer = pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
        if request.direction == pb.DIRECTION_PUBLISH:
            owner, header = self._authorize_header(context, request.publish), request.publish  # owner: names its upload
            if self.relay is not None:
                self.relay.refuse("publishes")
            self.publishes.check(header)
            accept = request.accept if header.total_bytes else []  # (the stream stages nothing: it is the default)
            for transport in filter(None, map(self.transports.get, accept)):
                if (upload := await asyncio.to_thread(transport.stage, header, owner, answer.payload)) is not None:
                    answer.transport, answer.upload = transport.kind, upload.id
                    answer.payload.byte_size = header.total_bytes
                    break
            return answer
        if request.direction != pb.DIRECTION_FETCH:
            raise InvalidRequest("Negotiate needs a direction: DIRECTION_FETCH or DIRECTION_PUBLISH")
        if request.fetch.WhichOneof("selector") == "incoming":
            announced = self.incoming.get(request.fetch.incoming, request.fetch.model)
            for transport in filter(None, map(self.transports.get, request.accept)):
                if transport.offer_incoming(announced, answer.payload):
                    answer.transport, answer.payload.byte_size = transport.kind, announced.byte_size
                    # Logged as handed out (the bytes follow as they land): the one record of the
                    # cut-through transfers on every transport (the metrics count versions).
                    fields = {"model": announced.model, "bytes": announced.byte_size, "transport": transport.name}
                    log_event("fetch_incoming", context, **fields)
                    break
            return answer
        started, record = time.perf_counter(), self._chosen(request.fetch)
        if record is None:
            answer.up_to_date.latest_version = request.fetch.newer_than
            return answer
        selection = _resolved(record, request.fetch)
        answer.header.CopyFrom(version_message(record))
        for transport in filter(None, map(self.transports.get, request.accept)):
            payload, description = await self._payload_for(record, request.fetch, selection)
            if await transport.offer(record, payload, description):
                answer.payload.CopyFrom(description)
                answer.transport = transport.kind
                self._transferred("fetch", record, started, context, transport.name, sent=payload.byte_size)
                break
        return answer

    def _chosen(self, request: pb.FetchRequest) -> Version | None:
        """The version a fetch asks for; None when `newer_than` found nothing newer."""
        if request.dtype and request.dtype not in CAST_TARGETS:
            raise InvalidRequest(
                f"cannot cast to {clipped_repr(request.dtype)}: choose one of {', '.join(CAST_TARGETS)} or ''"
            )
        selector = request.WhichOneof("selector")
        if selector == "version":
            if request.version == 0:
                raise InvalidRequest("version must be >= 1 (leave it unset to fetch the latest)")
            return self.store.get(request.model, request.version)
        if selector == "newer_than":
            return self.store.newer_than(request.model, request.newer_than)
        return self.store.latest(request.model)

    async def _payload_for(
        self, record: Version, request: pb.FetchRequest, selection: Resolved | None
    ) -> tuple[Payload, pb.Payload]:
        """What to send for `record` (itself or `selection` of it, as a delta or a cast), and its description."""
        base = base_selection = None
        if request.base_version and request.base_version < record.version:
            # Evicted, deleted, or the selection does not fit it: the caller gets every tensor.
            with contextlib.suppress(WeightServerError):
                base = self.store.get(record.model, request.base_version)
                base_selection = _resolved(base, request)
        if base is None and not request.dtype and (selection is None or not selection.key):
            payload = self.payloads.get(record, selection=selection)  # the version itself: nothing to build
        else:
            forms = tuple(form for form, wire in deltas.WIRE.items() if wire in request.element_deltas)
            build = functools.partial(self.payloads.get, selection=selection, base_selection=base_selection)
            payload = await asyncio.to_thread(build, record, base, request.dtype, forms)
        described = ("byte_size", "xxh3", "base_version", "dtype", "base_xxh3")
        description = pb.Payload(**{name: getattr(payload, name) for name in described})
        if selection is not None and payload.selection is not None:
            description.selection.CopyFrom(selection_message(payload.selection))
        return payload, description

    def _transferred(
        self, kind: str, record: Version, started: float, context: Context, transport: str, **more: Any
    ) -> None:
        """Log a finished publish or fetch and count a fetch (a publish is counted in its commit)."""
        seconds, nbytes = time.perf_counter() - started, more.pop("sent", record.byte_size)
        model, version = record.model, record.version
        if kind == "fetch":
            self.metrics.fetched(model, version, nbytes, seconds, transport=transport, client_id=client_id_of(context))
        fields = {"model": model, "version": version, "bytes": nbytes, "transport": transport}
        log_event(kind, context, **fields, duration_ms=round(seconds * 1e3, 3), **more)

    @streaming
    def Watch(self, request: pb.WatchRequest, context: Context) -> AsyncIterator[pb.VersionEvent]:
        return self.watches.watch(request, context)


def _resolved(record: Version, request: pb.FetchRequest) -> Resolved | None:
    """The request's selection resolved on `record`; None without one. InvalidRequest if it does not fit."""
    return Selection.from_message(request.select).resolve(record.header.tensors) if request.HasField("select") else None


def _rewrite_header(shm: SharedMemoryTransport, model: str, version: int, sha256: Future[str]) -> None:
    if sha256.exception() is None:
        shm.write_header(model, version)
