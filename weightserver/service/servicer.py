"""WeightServicer: weightserver.v1.WeightService, one short method per RPC.

Runs on grpc.aio. Work that hashes, parses or fsyncs runs in threads, so one large publish never
stalls the event loop that serves fetches and watchers. Requests are checked against the
caller's token (`auth`), domain errors leave as their status code (`_abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from weightserver.config import ServerConfig, clamp_chunk_bytes
from weightserver.metrics import NoMetrics
from weightserver.protocol.errors import (
    ERROR_METADATA_KEY,
    InvalidRequest,
    PermissionDenied,
    WeightServerError,
    clipped_message,
    status_code_for,
)
from weightserver.protocol.version_info import summary_message, version_message
from weightserver.publish.call import Published, Publishes
from weightserver.publish.incoming import IncomingPublishes
from weightserver.publish.priority import CommitsFirst
from weightserver.publish.staged_uploads import StagedUploads
from weightserver.service import negotiate, wire
from weightserver.service.auth import Principal, TokenTable
from weightserver.service.call_log import client_id_of, log, log_event
from weightserver.service.fetch import chosen_version, payload_for, sha256_of
from weightserver.service.watch import Watches
from weightserver.storage.payloads import PayloadCache
from weightserver.storage.store import Version, VersionStore
from weightserver.transports.base import ServerTransport
from weightserver.transports.bulk import BulkEndpoint, BulkTransport
from weightserver.transports.shared_memory import SharedMemoryFiles, SharedMemoryTransport
from weightserver.transports.stream import StreamTransport
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from weightserver.relay.relay import Relay

F = TypeVar("F", bound=Callable[..., Any])


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status of `error` (INTERNAL for anything unexpected)."""
    if isinstance(error, WeightServerError):
        code, name, message = status_code_for(error), type(error).__name__, str(error)
    else:
        log.exception("internal error in %s", context.peer())
        code, name = grpc.StatusCode.INTERNAL, "InternalServerError"
        message = f"internal server error ({type(error).__name__}); see the server log"
    # Clipped: an oversized status fails the call on the client with RESOURCE_EXHAUSTED instead.
    await context.abort(code, clipped_message(message), trailing_metadata=((ERROR_METADATA_KEY, name),))


def _unary(method: F) -> F:
    """Authorize a unary call and map the domain exceptions its handler raises to its status."""

    @functools.wraps(method)
    async def wrapper(self: WeightServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            # The model a call changes (DeleteVersion, PinVersion) counts for model-scoped tokens;
            # a Publish stream's headers are checked as they arrive.
            self._authorize(context, method.__name__, getattr(request, "model", None))
            if isinstance(request, wire.Undecodable):
                raise request.error()
            if self.relay is not None and method.__name__ in ("Publish", "DeleteVersion", "PinVersion"):
                self.relay.refuse(method.__name__)  # NotPrimary, naming the primary
            return await method(self, request, context)
        except Exception as error:
            await _abort(context, error)

    return wrapper  # type: ignore[return-value]


def _streaming(method: F) -> F:
    """The same for a server-streaming call."""

    @functools.wraps(method)
    async def wrapper(self: WeightServicer, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            self._authorize(context, method.__name__)
            if isinstance(request, wire.Undecodable):
                raise request.error()
            # Closed as soon as the call ends, so a fetch hands back its turn at once.
            async with contextlib.aclosing(method(self, request, context)) as messages:
                async for message in messages:
                    yield message
        except Exception as error:
            await _abort(context, error)

    return wrapper  # type: ignore[return-value]


class WeightServicer(pb_grpc.WeightServiceServicer):
    """Implements weightserver.v1.WeightService on top of a VersionStore."""

    def __init__(
        self,
        store: VersionStore,
        config: ServerConfig,
        *,
        payloads: PayloadCache | None = None,
        bulk: BulkEndpoint | None = None,
        shared_memory: SharedMemoryFiles | None = None,
        tokens: TokenTable | None = None,
        metrics: NoMetrics | None = None,
    ) -> None:
        self.store = store
        self.tokens = tokens
        self.config = config
        self.payloads = payloads or PayloadCache(config.payload_cache_bytes)
        self.metrics = metrics or NoMetrics()
        self.relay: Relay | None = None  # set on a relay: it refuses changes and names its primary to watchers
        self.commits_first = CommitsFirst()
        self.incoming = IncomingPublishes()  # publishes whose bytes are arriving, for cut-through
        self.staged = StagedUploads(store.header_limits, incoming=self.incoming)
        self.publishes = Publishes(
            store,
            shared_memory=shared_memory,
            announcements=self.incoming,
            staged=self.staged,
            timeout=config.publish_timeout,
        )
        self.watches = Watches(store, self.incoming, self.metrics, self._watch_metadata)
        self.stream = StreamTransport(config.max_stream_fetches, self.commits_first)
        self.shared_memory = SharedMemoryTransport(shared_memory, self.staged, store) if shared_memory else None
        offered = [self.stream, self.shared_memory, BulkTransport(bulk, self.staged, shared_memory) if bulk else None]
        self.transports: dict[int, ServerTransport] = {t.kind: t for t in offered if t is not None}
        store.subscribe(self._on_commit)
        for summary in store.models():  # versions loaded from a data dir
            self.metrics.retained(summary.model, store.versions(summary.model))

    def close(self) -> None:
        """Let the publish threads go and drop uploads nobody committed (after the server stopped)."""
        self.publishes.close()
        self.staged.close()

    def end_watches(self) -> None:
        """End every Watch with UNAVAILABLE, so watchers resubscribe (on the server's loop)."""
        self.watches.end_all()

    def _authorize(self, context: grpc.aio.ServicerContext, method: str, model: str | None = None) -> Principal | None:
        """With --auth-tokens, the caller's token must allow `method` (on `model`): its principal."""
        return self.tokens.authorize(context.invocation_metadata(), method, model) if self.tokens else None

    def _authorize_header(self, context: grpc.aio.ServicerContext, header: pb.PublishHeader) -> Principal | None:
        """The caller's token must allow publishing `header.model`, and pinning it with pin=True."""
        principal = self._authorize(context, "Publish", header.model)
        try:
            if header.pin:
                self._authorize(context, "PinVersion", header.model)
        except PermissionDenied as exc:
            raise PermissionDenied(f"a publish with pin=True pins the version: {exc}") from None
        return principal

    def _watch_metadata(self) -> list[tuple[str, str]]:
        return list(self.relay.watch_metadata()) if self.relay is not None else []

    def _on_commit(self, record: Version) -> None:
        """Store listener: a commit may have evicted older versions. A version committed without
        its sha256 gets its shared-memory header rewritten once the store has computed it."""
        self.forget_removed(record.model)
        if not record.sha256 and self.shared_memory is not None:
            shm, model, version = self.shared_memory, record.model, record.version  # not the record: its bytes may go
            self.store.sha256_of(record, hurry=False).add_done_callback(
                lambda future: future.exception() is None and shm.write_header(model, version)
            )

    def forget_removed(self, model: str) -> None:
        """Drop derived payloads and shared-memory files of versions no longer retained, and
        update the retention metrics."""
        try:
            versions = self.store.versions(model)
        except WeightServerError:
            versions = []
        self.metrics.retained(model, versions)
        files = self.shared_memory.files if self.shared_memory is not None else None
        keys = [*self.payloads.keys(), *(files.keys() if files is not None else ())]
        derived = {v for m, version, base, _ in keys if m == model for v in (version, base) if v}
        for version in derived - {v.version for v in versions}:
            self.payloads.forget(model, version)
            if files is not None:
                files.forget(model, version)

    # ------------------------------------------------------------------ publish
    @_unary
    async def Publish(
        self, request_iterator: AsyncIterator[pb.PublishRequest], context: grpc.aio.ServicerContext
    ) -> pb.PublishResponse:
        started, published = time.perf_counter(), Published()
        caller = self._authorize(context, "Publish")
        owner = caller.token_sha256 if caller is not None else None
        # Whose bucket of waiting hold the publish draws on: its token's, or its host's.
        bucket = f"token {owner.hex()}" if owner is not None else "peer " + context.peer().rpartition(":")[0]

        def counted(record: Version) -> None:  # in the commit: who sees the version finds it counted
            self.metrics.published(record.model, record.byte_size, time.perf_counter() - started)

        with self.commits_first.publish(bucket) as turn:
            messages = self._checked_headers(request_iterator, context)
            await self.publishes.receive(messages, turn, published, owner=owner, counted=counted)
        phases = {
            "receive_ms": round(published.receive * 1e3, 3),
            "verify_ms": round(published.verify * 1e3, 3),
            "commit_ms": round(published.commit * 1e3, 3),
        }
        for model, record in zip(published.models, published.records, strict=True):
            if published.repeat:
                log_event("publish_repeat", context, model=record.model, version=record.version)
            else:
                self._transferred("publish", record, started, context, model.transport, **phases)
        infos = [version_message(r) for r in published.records]
        return pb.PublishResponse(version=infos[0], versions=infos)

    async def _checked_headers(
        self, messages: AsyncIterator[pb.PublishRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PublishRequest]:
        """The stream's messages, each header checked against the caller's token before its bytes."""
        async for message in messages:
            if isinstance(message, wire.Undecodable):
                raise message.error()
            if message.WhichOneof("kind") == "header":
                self._authorize_header(context, message.header)
            yield message

    # ------------------------------------------------------------------ describe
    @_unary
    async def GetLatest(self, request: pb.GetLatestRequest, context: grpc.aio.ServicerContext) -> pb.VersionInfo:
        return version_message(self.store.latest(request.model))

    @_unary
    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.VersionInfo:
        record = self.store.get(request.model, request.version) if request.version else self.store.latest(request.model)
        return version_message(record)

    @_unary
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[summary_message(m) for m in self.store.models()])

    @_unary
    async def ListVersions(
        self, request: pb.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVersionsResponse:
        return pb.ListVersionsResponse(versions=[version_message(v) for v in self.store.versions(request.model)])

    @_unary
    async def DeleteVersion(
        self, request: pb.DeleteVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteVersionResponse:
        record = await asyncio.to_thread(self.store.delete, request.model, request.version)
        self.forget_removed(record.model)
        log_event("delete", context, model=record.model, version=record.version)
        return pb.DeleteVersionResponse(deleted=version_message(record))

    @_unary
    async def PinVersion(self, request: pb.PinVersionRequest, context: grpc.aio.ServicerContext) -> pb.VersionInfo:
        record = await asyncio.to_thread(self.store.set_pinned, request.model, request.version, request.pinned)
        self.forget_removed(record.model)
        if self.shared_memory is not None:
            await asyncio.to_thread(self.shared_memory.write_header, record.model, record.version)
        log_event("pin" if record.pinned else "unpin", context, model=record.model, version=record.version)
        return version_message(record)

    # ------------------------------------------------------------------ fetch
    @_streaming
    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FetchResponse | bytes]:
        started, chunk_bytes = time.perf_counter(), clamp_chunk_bytes(request.chunk_size, self.config.chunk_bytes)
        if request.WhichOneof("selector") == "incoming":  # a publish's bytes as they land
            announced = self.incoming.get(request.incoming, request.model)
            yield pb.FetchResponse(payload=pb.Payload(byte_size=announced.byte_size))
            async with contextlib.aclosing(self.stream.send_incoming(announced, chunk_bytes)) as chunks:
                async for message in chunks:
                    yield message
            ms = round((time.perf_counter() - started) * 1e3, 3)
            log_event("fetch_incoming", context, model=announced.model, bytes=announced.byte_size, duration_ms=ms)
            return
        record = chosen_version(self.store, request)
        if record is None:
            yield pb.FetchResponse(up_to_date=pb.UpToDate(latest_version=request.newer_than))
            return
        header = version_message(record)
        if not header.sha256:  # published with only an xxh3: its sha256 is being computed
            header.sha256 = await sha256_of(self.store, record)
        yield pb.FetchResponse(header=header)
        payload, description = await payload_for(self.store, self.payloads, record, request)
        if request.base_version or request.dtype:
            yield pb.FetchResponse(payload=description)
        async with contextlib.aclosing(self.stream.send(payload.data, chunk_bytes)) as chunks:
            async for message in chunks:
                yield message
        self._transferred("fetch", record, started, context, "stream", sent=payload.byte_size)

    @_unary
    async def Negotiate(self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext) -> pb.NegotiateResponse:
        if request.direction == pb.DIRECTION_PUBLISH:
            caller = self._authorize_header(context, request.publish)
            if self.relay is not None:
                self.relay.refuse("Negotiate")
            self.publishes.check(request.publish)
            owner = caller.token_sha256 if caller is not None else None
            return await negotiate.publish(self.transports, request, owner)
        if request.direction != pb.DIRECTION_FETCH:
            raise InvalidRequest("Negotiate needs a direction: DIRECTION_FETCH or DIRECTION_PUBLISH")
        if request.fetch.WhichOneof("selector") == "incoming":
            announced = self.incoming.get(request.fetch.incoming, request.fetch.model)
            return negotiate.incoming(self.transports, announced, request)
        started = time.perf_counter()
        record = chosen_version(self.store, request.fetch)
        answer, transport, payload = await negotiate.fetch(self.transports, self.store, self.payloads, record, request)
        if record is not None and transport is not None and payload is not None:
            self._transferred("fetch", record, started, context, transport.name, sent=payload.byte_size)
        return answer

    def _transferred(
        self,
        kind: str,
        record: Version,
        started: float,
        context: grpc.aio.ServicerContext,
        transport: str,
        sent: int | None = None,
        **phases: float,
    ) -> None:
        """Log one finished publish or fetch, and count a fetch (a publish is counted in its
        commit). For shm and bulk the duration covers handing out the file or ticket."""
        seconds, nbytes = time.perf_counter() - started, record.byte_size if sent is None else sent
        if kind == "fetch":
            client_id = client_id_of(context)
            self.metrics.fetched(
                record.model, record.version, nbytes, seconds, transport=transport, client_id=client_id
            )
        log_event(
            kind,
            context,
            model=record.model,
            version=record.version,
            bytes=nbytes,
            transport=transport,
            duration_ms=round(seconds * 1e3, 3),
            **phases,
        )

    # ------------------------------------------------------------------ watch
    @_streaming
    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.VersionEvent]:
        async with contextlib.aclosing(self.watches.watch(request, context)) as events:
            async for event in events:
                yield event
