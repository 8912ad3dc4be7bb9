"""The gRPC servicer: checks requests, calls the VersionStore, maps errors to status codes.

Runs on grpc.aio. Store calls that hash, parse or fsync run in worker threads so one large
publish never stalls the event loop that serves fetches and watchers; a publish's commit has
threads of its own, so no backlog of other work (casts, deltas) queues in front of it. Stream
fetches send chunks a bounded number at a time (`--max-stream-fetches`), the rest waiting
their turn, so that a publish's chunks share the loop with a few fetches, not with every open one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import mmap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from weightserver.config import ServerConfig, clamp_chunk_bytes
from weightserver.metrics import NoMetrics
from weightserver.protocol import framing
from weightserver.protocol.digests import IncomingDigests, sha256_hex
from weightserver.protocol.errors import (
    CLIENT_ID_METADATA_KEY,
    ERROR_METADATA_KEY,
    DeadlineExceeded,
    IntegrityError,
    InvalidRequest,
    InvalidSafetensors,
    PermissionDenied,
    PublishAborted,
    ServerUnavailable,
    WeightServerError,
    clipped_message,
    clipped_repr,
    status_code_for,
)
from weightserver.protocol.names import validate_model_name
from weightserver.publish.incoming import IncomingPublish, IncomingPublishes
from weightserver.publish.priority import CommitsFirst, PublishTurn
from weightserver.publish.staged_uploads import StagedUpload, StagedUploads
from weightserver.service import wire
from weightserver.service.auth import Principal, TokenTable
from weightserver.storage.payloads import CAST_TARGETS, Payload, PayloadCache
from weightserver.storage.store import Commit, Upload, Version, VersionStore
from weightserver.transports.bulk import BulkEndpoint
from weightserver.transports.shared_memory import SharedMemoryFiles, SharedMemoryUpload
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from weightserver.relay.relay import Relay

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Threads that verify and commit publishes (hash, parse, fsync), apart from asyncio's default
# pool, which also builds casts and deltas for fetches.
PUBLISH_THREADS = 4
# A stream publish's sha256, when it is computed, is handed to its thread this many bytes at a time.
SHA256_BATCH_BYTES = 4 << 20
# A fetch whose chunk write has not completed after this long (its reader stopped reading or
# reads slowly) gives its turn back for the rest of the fetch: a stalled stream costs the
# loop nothing, and must not hold up the fetches queued behind it.
SLOW_READER_SECONDS = 1.0
# A fetch of a publish's bytes as they arrive gives up when none arrive for this long.
ARRIVING_STALL_SECONDS = 60.0


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status of `error` (INTERNAL for anything unexpected)."""
    if isinstance(error, WeightServerError):
        code, name, message = status_code_for(error), type(error).__name__, str(error)
    else:
        log.exception("internal error in %s", context.peer())
        code, name = grpc.StatusCode.INTERNAL, "InternalServerError"
        message = f"internal server error ({type(error).__name__}); see the server log"
    # Cut, whatever the message quotes: an oversized status would fail the call on the client
    # with RESOURCE_EXHAUSTED (its metadata limit) instead of this status.
    await context.abort(code, clipped_message(message), trailing_metadata=((ERROR_METADATA_KEY, name),))


async def _within(messages: AsyncIterator[T], seconds: float | None) -> AsyncIterator[T]:
    """The messages of a client stream, as long as the whole stream takes at most `seconds`: a
    stalled publisher must not hold its receive buffer forever."""
    if seconds is None:
        async for message in messages:
            yield message
        return
    deadline = asyncio.get_running_loop().time() + seconds
    iterator = aiter(messages)
    while True:
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(anext(iterator), max(remaining, 0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the publish stream took longer than the server's limit of {seconds:g}s and was dropped "
                "(nothing was published); raise `weightserver serve --publish-timeout` for larger models "
                "or slower links"
            ) from None
        yield message


def _unary(method: F) -> F:
    """Map domain exceptions raised by a unary handler to its gRPC status."""

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
    """Map domain exceptions raised by a server-streaming handler to its gRPC status."""

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
        self.bulk = bulk
        self.shared_memory = shared_memory
        self.metrics = metrics or NoMetrics()
        self.relay: Relay | None = None  # set on a relay: it refuses changes and names its primary to watchers
        self._watch_queues: set[asyncio.Queue[Version | IncomingPublish | None]] = set()
        self._stream_turns = asyncio.Semaphore(config.max_stream_fetches)
        self._commits_first = CommitsFirst()
        self._publish_threads = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="weightserver-publish")
        # Publishes whose bytes are arriving, for watchers that fetch them early (cut-through).
        self.incoming = IncomingPublishes()
        self.staged = StagedUploads(store.header_limits, incoming=self.incoming)
        # The fast transports this server offers to Negotiate, in no order: the caller's decides.
        # Each with the name its transfers are logged and counted under.
        # An offer that returns False cannot carry this payload now: the next one is tried.
        self._offers: dict[int, tuple[str, Callable[[Version, Payload, pb.Payload], Awaitable[bool]]]] = {}
        if shared_memory is not None:
            self._offers[pb.TRANSPORT_SHARED_MEMORY] = ("shm", self._offer_shared_memory)
        if bulk is not None:
            self._offers[pb.TRANSPORT_BULK] = ("bulk", self._offer_bulk)
        store.subscribe(self._on_commit)
        for summary in store.models():  # versions loaded from a data dir
            self.metrics.retained(summary.model, store.versions(summary.model))

    def close(self) -> None:
        """Let the publish threads go and drop uploads nobody committed (after the server stopped)."""
        self._publish_threads.shutdown(wait=False, cancel_futures=True)
        self.staged.close()

    def _authorize(self, context: grpc.aio.ServicerContext, method: str, model: str | None = None) -> Principal | None:
        """With --auth-tokens, the caller's bearer token must allow `method` (on `model`): its
        principal; None without tokens."""
        if self.tokens is None:
            return None
        return self.tokens.authorize(context.invocation_metadata(), method, model)

    def _on_commit(self, commit: Commit) -> None:
        """Store listener: a commit may have evicted older versions. A version committed without
        its sha256 gets its shared-memory header rewritten once the store has computed it."""
        for record in commit.versions:
            self.forget_removed(record.model)
            if not record.sha256 and self.shared_memory is not None:
                self.store.sha256_of(record, hurry=False).add_done_callback(
                    functools.partial(self._rewrite_shm_header, record.model, record.version)
                )

    def _rewrite_shm_header(self, model: str, version: int, sha256: Future[str]) -> None:
        if sha256.exception() is None:
            self._write_shm_header(model, version)

    def _write_shm_header(self, model: str, version: int) -> None:
        """Write the header file beside a version's shared-memory file from the store's
        current record (after a pin, or once the file was written on demand)."""
        if self.shared_memory is None:
            return

        def current() -> bytes | None:
            try:
                return wire.version_info(self.store.get(model, version)).SerializeToString()
            except WeightServerError:
                return None  # evicted or deleted meanwhile: its files go with it

        self.shared_memory.write_header(model, version, current)

    def forget_removed(self, model: str) -> None:
        """Drop derived payloads and shared-memory files of versions no longer retained
        (after a commit evicted some, a delete, or an unpin), and update the retention metrics."""
        try:
            versions = self.store.versions(model)
        except WeightServerError:
            versions = []
        self.metrics.retained(model, versions)
        retained = {v.version for v in versions}
        for version in self._derived_versions(model) - retained:
            self.payloads.forget(model, version)
            if self.shared_memory is not None:
                self.shared_memory.forget(model, version)

    def _derived_versions(self, model: str) -> set[int]:
        keys = list(self.payloads.keys()) + (list(self.shared_memory.keys()) if self.shared_memory else [])
        return {v for m, version, base, _ in keys if m == model for v in (version, base) if v}

    # ------------------------------------------------------------------ publish
    @_unary
    async def Publish(
        self, request_iterator: AsyncIterator[pb.PublishRequest], context: grpc.aio.ServicerContext
    ) -> pb.PublishResponse:
        started = time.perf_counter()
        incoming: list[_IncomingModel] = []
        failure = "the publish stream ended without committing"
        try:
            caller = self._authorize(context, "Publish")
            with self._commits_first.publish(_hold_bucket(caller, context)) as turn:
                messages = self._checked_headers(request_iterator, context)
                records = await self._receive_and_commit(messages, incoming, turn, started, caller)
            failure = "a repeat of a publish id committed before: its version was announced then"
        except BaseException as exc:
            failure = clipped_message(str(exc) or type(exc).__name__, 200)
            raise
        finally:
            for model in incoming:
                if model.staged is not None:
                    model.staged.settle()  # no thread is left hashing a file about to go
                if model.upload is not None and model.upload.path.exists():
                    model.upload.abort()  # a publish that did not commit leaves no file
                if model.arriving is not None and not model.committed:
                    model.arriving.fail(failure)  # followers that took bytes early drop them
        if incoming[0].committed:  # counted in the commit (`_counted`); logged here
            for model, record in zip(incoming, records, strict=True):
                self._transferred("publish", record, started, context, transport=model.transport)
        else:  # a repeat of a publish id: the versions an earlier call committed
            for record in records:
                _log_event("publish_repeat", context, model=record.model, version=record.version)
        infos = [wire.version_info(r) for r in records]
        return pb.PublishResponse(version=infos[0], versions=infos)

    async def _checked_headers(
        self, messages: AsyncIterator[pb.PublishRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PublishRequest]:
        """The publish stream's messages, each header checked against the caller's token as it
        arrives, before its bytes: its model must be one the token may publish, and pin=True
        pins the version, which needs what PinVersion needs. A message that does not parse
        ends the stream with InvalidRequest."""
        async for message in messages:
            if isinstance(message, wire.Undecodable):
                raise message.error()
            if message.WhichOneof("kind") == "header":
                self._authorize_header(context, message.header)
            yield message

    def _authorize_header(self, context: grpc.aio.ServicerContext, header: pb.PublishHeader) -> Principal | None:
        """The caller's token must allow publishing `header.model`, and pinning it with pin=True:
        its principal; None without tokens."""
        if self.tokens is None:
            return None
        principal = self._authorize(context, "Publish", header.model)
        try:
            if header.pin:
                self._authorize(context, "PinVersion", header.model)
        except PermissionDenied as exc:
            raise PermissionDenied(f"a publish with pin=True pins the version: {exc}") from None
        return principal

    async def _receive_and_commit(
        self,
        request_iterator: AsyncIterator[pb.PublishRequest],
        incoming: list[_IncomingModel],
        turn: PublishTurn,
        started: float,
        caller: Principal | None = None,
    ) -> list[Version]:
        """Receive the stream's models, then verify and commit them, telling `turn` what
        arrives: stream fetches let the publish go first while the server sets its pace.
        `caller` may name only the uploads its own Negotiate set up."""
        commit: pb.PublishCommit | None = None
        async for message in _within(request_iterator, self.config.publish_timeout):
            kind = message.WhichOneof("kind")
            if commit is not None:
                raise InvalidRequest(f"model {incoming[0].header.model!r}: nothing may follow the commit message")
            if kind == "header":
                if any(m.header.model == message.header.model for m in incoming):
                    raise InvalidRequest(f"model {message.header.model!r} appears twice in one publish")
                if incoming:
                    incoming[-1].check_complete()
                    _check_group_header(incoming[0].header, message.header)
                header = message.header
                _check_publish(self.store, header, incoming[0].header if incoming else header)
                counted = functools.partial(self._counted, started=started)
                incoming.append(
                    _IncomingModel(header, self.shared_memory, self.store.header_limits, self.incoming, counted)
                )
                turn.header()
            elif not incoming:
                raise InvalidRequest("a Publish stream must start with a header message (model, total_bytes, sha256)")
            elif kind == "chunk":
                turn.chunk()
                incoming[-1].add(message.chunk)
            elif kind == "written":
                # The header's hold goes on: a same-host writer's pace is a memory copy, the
                # hashing is the server's, and the hold's budget runs out anyway (commits_first).
                incoming[-1].written(message.written, self.staged, _owner(caller))
                turn.written()
            elif kind == "uploaded":
                incoming[-1].uploaded(message.uploaded, self.staged, _owner(caller))
                turn.uploaded()
            elif kind == "commit":
                incoming[-1].check_complete()
                commit = message.commit
                turn.bytes_in()
            else:
                raise InvalidRequest(f"model {incoming[-1].header.model!r}: unexpected {kind!r} message")
        if not incoming:
            raise InvalidRequest("a Publish stream must start with a header message (model, total_bytes, sha256)")
        if commit is None:
            incoming[-1].check_complete()
            models = ", ".join(repr(m.header.model) for m in incoming)
            raise InvalidRequest(
                f"model {models}: the publish stream ended without a commit message, so nothing "
                "was published (the publisher was cancelled or failed before finishing)"
            )
        digests = _declared_sha256s(incoming, commit)
        uploads = [await model.as_upload(digest) for model, digest in zip(incoming, digests, strict=True)]
        publish = functools.partial(self._commit, incoming, uploads)
        committing = asyncio.get_running_loop().run_in_executor(self._publish_threads, publish)
        try:
            return await asyncio.shield(committing)
        finally:
            # A call cancelled meanwhile (its deadline passed) leaves the commit running in its
            # thread: it finishes with the uploads before Publish cleans them up, and a retry
            # with the same publish id finds its version.
            await asyncio.wait([committing])

    def _commit(self, incoming: list[_IncomingModel], uploads: list[Upload]) -> list[Version]:
        """In a publish thread: each model's bytes adopt their version once it is durable and
        before anyone can see it; on a replay of a publish id the bytes become nothing."""
        first = incoming[0].header
        with self.store.commit(uploads, version=first.version, publish_id=first.publish_id) as commit:
            if not commit.replayed:
                for model, record in zip(incoming, commit.versions, strict=True):
                    model._adopt(record)
        return list(commit.versions)

    # ------------------------------------------------------------------ describe
    @_unary
    async def GetLatest(self, request: pb.GetLatestRequest, context: grpc.aio.ServicerContext) -> pb.VersionInfo:
        return wire.version_info(self.store.latest(request.model))

    @_unary
    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.VersionInfo:
        record = self.store.get(request.model, request.version) if request.version else self.store.latest(request.model)
        return wire.version_info(record)

    @_unary
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[wire.model_summary(m) for m in self.store.models()])

    @_unary
    async def ListVersions(
        self, request: pb.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVersionsResponse:
        return pb.ListVersionsResponse(versions=[wire.version_info(v) for v in self.store.versions(request.model)])

    @_unary
    async def DeleteVersion(
        self, request: pb.DeleteVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteVersionResponse:
        record = await asyncio.to_thread(self.store.delete, request.model, request.version)
        self.forget_removed(record.model)
        _log_event("delete", context, model=record.model, version=record.version)
        return pb.DeleteVersionResponse(deleted=wire.version_info(record))

    @_unary
    async def PinVersion(self, request: pb.PinVersionRequest, context: grpc.aio.ServicerContext) -> pb.VersionInfo:
        record = await asyncio.to_thread(self.store.set_pinned, request.model, request.version, request.pinned)
        self.forget_removed(record.model)
        await asyncio.to_thread(self._write_shm_header, record.model, record.version)
        _log_event("pin" if record.pinned else "unpin", context, model=record.model, version=record.version)
        return wire.version_info(record)

    # ------------------------------------------------------------------ fetch
    @_streaming
    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FetchResponse | bytes]:
        started = time.perf_counter()
        if request.WhichOneof("selector") == "incoming":
            async with contextlib.aclosing(self._fetch_arriving(request, context)) as messages:
                async for message in messages:
                    yield message
            return
        record = self._fetched_version(request)
        if record is None:
            yield pb.FetchResponse(up_to_date=pb.UpToDate(latest_version=request.newer_than))
            return
        header = wire.version_info(record)
        if not header.sha256:  # published with only an xxh3: its sha256 is being computed
            header.sha256 = await self._sha256(record)
        yield pb.FetchResponse(header=header)
        payload, description = await self._payload(record, request)
        if request.base_version or request.dtype:
            yield pb.FetchResponse(payload=description)
        chunk_bytes = clamp_chunk_bytes(request.chunk_size, self.config.chunk_bytes)
        async with contextlib.aclosing(self._in_turn(framing.chunk_messages(payload.data, chunk_bytes))) as chunks:
            async for message in chunks:
                yield message
        self._transferred("fetch", record, started, context, transport="stream", sent=payload.byte_size)

    async def _fetch_arriving(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FetchResponse | bytes]:
        """A publish's bytes as they land (cut-through): the payload's size, then chunks."""
        started = time.perf_counter()
        arriving = self.incoming.get(request.incoming, request.model)
        yield pb.FetchResponse(payload=pb.Payload(byte_size=arriving.byte_size))
        chunk_bytes = clamp_chunk_bytes(request.chunk_size, self.config.chunk_bytes)
        sent = 0
        while sent < arriving.byte_size:
            try:
                landed = await arriving.landed_beyond(sent, ARRIVING_STALL_SECONDS)
            except TimeoutError:
                raise PublishAborted(
                    f"the publish of {arriving.model!r} sent nothing for {ARRIVING_STALL_SECONDS:g}s; "
                    "fetch the version once it is committed"
                ) from None
            for message in framing.chunk_messages(arriving.buffer[sent:landed], chunk_bytes):
                yield message
            sent = landed
        seconds = time.perf_counter() - started
        _log_event("fetch_arriving", context, model=arriving.model, bytes=sent, duration_ms=round(seconds * 1e3, 3))

    async def _sha256(self, record: Version) -> str:
        """The sha256 the store computes after the commit, awaited without holding up the loop;
        if the version was evicted or deleted before its turn, this fetch hashes the bytes it
        holds."""
        try:
            return await asyncio.wrap_future(self.store.sha256_of(record))
        except WeightServerError:
            return await asyncio.to_thread(sha256_hex, record.data)

    async def _in_turn(self, messages: Iterable[bytes]) -> AsyncIterator[bytes]:
        """`messages`, sent while this fetch holds one of the --max-stream-fetches turns (first
        waiting for one, first come first served), each after any publish that goes first
        (`CommitsFirst`). A write still pending after SLOW_READER_SECONDS gives the turn
        back for the rest of the fetch."""
        turns, loop = self._stream_turns, asyncio.get_running_loop()
        await turns.acquire()
        held = True

        def give_back() -> None:
            nonlocal held
            if held:
                held = False
                turns.release()

        try:
            for message in messages:
                await self._commits_first.wait()
                slow = loop.call_later(SLOW_READER_SECONDS, give_back)
                try:
                    yield message
                finally:
                    slow.cancel()
        finally:
            give_back()

    @_unary
    async def Negotiate(self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext) -> pb.NegotiateResponse:
        stream = pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
        if request.direction == pb.DIRECTION_PUBLISH:
            return await self._negotiate_publish(request, context)
        if request.direction != pb.DIRECTION_FETCH:
            raise InvalidRequest("Negotiate needs a direction: DIRECTION_FETCH or DIRECTION_PUBLISH")
        if request.fetch.WhichOneof("selector") == "incoming":
            return self._negotiate_arriving(request)
        started = time.perf_counter()
        record = self._fetched_version(request.fetch)
        if record is None:
            stream.up_to_date.latest_version = request.fetch.newer_than
            return stream
        stream.header.CopyFrom(wire.version_info(record))
        for transport in request.accept:
            if transport not in self._offers:
                continue
            name, offer = self._offers[transport]
            payload, description = await self._payload(record, request.fetch)
            if not await offer(record, payload, description):
                continue
            stream.payload.CopyFrom(description)
            stream.transport = transport
            self._transferred("fetch", record, started, context, transport=name, sent=payload.byte_size)
            break
        return stream

    def _negotiate_arriving(self, request: pb.NegotiateRequest) -> pb.NegotiateResponse:
        """A bulk ticket for a publish's bytes as they land, when the caller takes bulk and
        this server offers it; else the stream (Fetch with the same `incoming`). Shared memory
        is not offered: a same-host reader gets the committed version's file as fast."""
        arriving = self.incoming.get(request.fetch.incoming, request.fetch.model)
        answer = pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
        if self.bulk is not None and pb.TRANSPORT_BULK in request.accept:
            answer.transport = pb.TRANSPORT_BULK
            answer.payload.byte_size = arriving.byte_size
            answer.payload.bulk.port = self.bulk.port
            label = f"{arriving.model!r} (arriving)"
            answer.payload.bulk.ticket = self.bulk.issue_arriving(arriving.buffer, label, arriving.landed_beyond)
        return answer

    async def _negotiate_publish(
        self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext
    ) -> pb.NegotiateResponse:
        """Set up one model's upload over the first fast transport the caller accepts that this
        server offers and has room for; TRANSPORT_STREAM when none (or no bytes)."""
        header = request.publish
        caller = self._authorize_header(context, header)
        if self.relay is not None:
            self.relay.refuse("Negotiate")
        _check_publish(self.store, header, header)
        answer = pb.NegotiateResponse(transport=pb.TRANSPORT_STREAM)
        for transport in request.accept if header.total_bytes else ():
            if transport == pb.TRANSPORT_SHARED_MEMORY and self.shared_memory is not None:
                upload = await asyncio.to_thread(self._stage, header, "shm", _owner(caller))
                if upload is None:
                    continue
                assert upload.file is not None and upload.file.source is not None
                answer.payload.shared_memory.path = str(upload.file.source.path)
            elif transport == pb.TRANSPORT_BULK and self.bulk is not None:
                upload = await asyncio.to_thread(self._stage, header, "bulk", _owner(caller))
                if upload is None:
                    continue
                answer.payload.bulk.port = self.bulk.port
                answer.payload.bulk.ticket = self.bulk.issue_upload(
                    upload.buffer, repr(header.model), upload.arrived, upload.transferred
                )
            else:
                continue
            answer.transport = transport
            answer.payload.byte_size = header.total_bytes
            answer.upload = upload.id
            break
        return answer

    def _stage(self, header: pb.PublishHeader, transport: str, owner: bytes | None) -> StagedUpload | None:
        """A staged upload for `header`'s bytes, in a shared-memory file where there is room
        (needed for "shm", with the file beside that the publisher writes), that only `owner`
        may name (see `StagedUploads.take`); None when "shm" finds none. This process writes the
        file, from a bulk socket (`recv_into`) or copying from the publisher's file (`pread`),
        so its page table for the file is filled ahead."""
        shared_memory, publisher_writes = self.shared_memory, transport == "shm"

        def new_file() -> Any:
            if shared_memory is None:
                return None
            return shared_memory.new_upload(
                header.model, header.total_bytes, populate=True, publisher_writes=publisher_writes
            )

        try:
            return self.staged.create(header.model, header.total_bytes, transport, new_file, owner=owner)
        except OSError:
            return None

    def _fetched_version(self, request: pb.FetchRequest) -> Version | None:
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

    async def _payload(self, record: Version, request: pb.FetchRequest) -> tuple[Payload, pb.Payload]:
        """What to send for `record` (the version itself, a delta or a cast) and its description."""
        base = self._base_version(record, request.base_version)
        if base is None and not request.dtype:
            payload = self.payloads.get(record)  # the version itself: nothing to build
        else:
            payload = await asyncio.to_thread(self.payloads.get, record, base, request.dtype)
        description = pb.Payload(
            byte_size=payload.byte_size,
            xxh3=payload.xxh3,
            base_version=payload.base_version,
            dtype=payload.dtype,
            base_xxh3=base.xxh3 if payload.base_version and base is not None else "",
        )
        return payload, description

    async def _offer_shared_memory(self, record: Version, payload: Payload, description: pb.Payload) -> bool:
        """Name the payload's file in the server's shared memory (written on first demand);
        False when it cannot be written there (the folder is full)."""
        key = (record.model, record.version, payload.base_version, payload.dtype)
        path = self.shared_memory.existing(key)
        if path is None:
            path = await asyncio.to_thread(self.shared_memory.path_for, key, payload.data)
            if path is None:
                return False
            if key[2:] == (0, ""):
                await asyncio.to_thread(self._write_shm_header, record.model, record.version)
        description.shared_memory.path = str(path)
        return True

    async def _offer_bulk(self, record: Version, payload: Payload, description: pb.Payload) -> bool:
        """Issue a ticket for the payload on the bulk port."""
        description.bulk.port = self.bulk.port
        description.bulk.ticket = self.bulk.issue(payload.data, f"{record.model} v{record.version}")
        return True

    def _transferred(
        self,
        kind: str,
        record: Version,
        started: float,
        context: grpc.aio.ServicerContext,
        *,
        transport: str = "stream",
        sent: int | None = None,
    ) -> None:
        """Log one finished publish or fetch, and count a fetch (a publish is counted in its
        commit, `_counted`). For shm and bulk the duration covers handing out the file or
        ticket; the bytes then move outside this call."""
        seconds = time.perf_counter() - started
        nbytes = record.byte_size if sent is None else sent
        if kind != "publish":
            self.metrics.fetched(
                record.model, record.version, nbytes, seconds, transport=transport, client_id=_client_id(context)
            )
        _log_event(
            kind,
            context,
            model=record.model,
            version=record.version,
            bytes=nbytes,
            transport=transport,
            duration_ms=round(seconds * 1e3, 3),
        )

    def _counted(self, record: Version, *, started: float) -> None:
        """Count a committed publish in the metrics. Called in the commit, before any reader
        can see the version: whoever sees it and then reads /metrics finds it counted."""
        self.metrics.published(record.model, record.byte_size, time.perf_counter() - started)

    def _base_version(self, record: Version, base_version: int) -> Version | None:
        """The caller's base version if it can serve as a delta base, else None (full payload)."""
        if not base_version or base_version >= record.version:
            return None
        try:
            return self.store.get(record.model, base_version)
        except WeightServerError:
            return None  # evicted or deleted: the caller gets every tensor

    # ------------------------------------------------------------------ watch
    @_streaming
    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.VersionEvent]:
        model = validate_model_name(request.model)
        loop = asyncio.get_running_loop()
        # Commits, and with `incoming` publishes as they start and fail; None: the server stops.
        queue: asyncio.Queue[Version | IncomingPublish | None] = asyncio.Queue()

        def on_event(event: Version | IncomingPublish) -> None:
            if event.model == model:
                with contextlib.suppress(RuntimeError):  # loop closed: the server is shutting down
                    loop.call_soon_threadsafe(queue.put_nowait, event)

        def on_commit(commit: Commit) -> None:
            for record in commit.versions:
                on_event(record)

        # Subscribe before reading the backlog so no version can land between the two.
        unsubscribes = [self.store.subscribe(on_commit)]
        if request.incoming:
            unsubscribes.append(self.incoming.subscribe(on_event))
        self.metrics.watch_started(model)
        self._watch_queues.add(queue)
        try:
            backlog, gap = self.store.versions_after(model, request.since)
            last = request.since
            # Headers now, not with the first event: a client waiting for them knows that its
            # subscription is live even when nothing has been published since its cursor.
            await context.send_initial_metadata(self.relay.watch_metadata() if self.relay is not None else ())
            _log_event("watch", context, model=model, since=request.since, backlog=len(backlog))
            for record in backlog:
                yield self._version_event(record, gap, request.incoming)
                gap = False
                last = record.version
            while True:
                event = await queue.get()
                if event is None:
                    raise ServerUnavailable("the server is shutting down; resubscribe with since=<last version seen>")
                if isinstance(event, IncomingPublish):
                    announced = pb.IncomingPublish(
                        id=event.id, byte_size=event.byte_size, failed=event.failure is not None
                    )
                    yield pb.VersionEvent(incoming=announced)
                    continue
                if event.version <= last:
                    continue
                # With an empty backlog the gap is reported on the first live event; on a relay,
                # also on an event after versions it missed (`VersionStore.missed`).
                gap = gap or self.store.gap_between(model, last, event.version)
                yield self._version_event(event, gap, request.incoming)
                gap = False
                last = event.version
        finally:
            self._watch_queues.discard(queue)
            for unsubscribe in unsubscribes:
                unsubscribe()
            self.metrics.watch_ended(model)

    def _version_event(self, record: Version, gap: bool, incoming: bool) -> pb.VersionEvent:
        """The event of a commit; for a watcher of incoming publishes, naming the announced
        bytes that became it, if any."""
        event = pb.VersionEvent(version=wire.version_info(record), gap=gap)
        announced = self.incoming.id_of(record.model, record.version) if incoming else ""
        if announced:
            event.incoming.id, event.incoming.byte_size = announced, record.byte_size
        return event

    def end_watches(self) -> None:
        """End every Watch stream with UNAVAILABLE, so that watchers resubscribe (to this server
        once it is back, or another) instead of being cancelled mid-call at shutdown. Call it on
        the server's event loop."""
        for queue in self._watch_queues:
            queue.put_nowait(None)


class _IncomingModel:
    """One model's bytes in a Publish stream: arriving as chunks, into a buffer of the declared
    size (a shared-memory file when the server has a shared-memory directory), each chunk
    hashed as it lands (xxh3 at once; sha256, when needed, in a thread of its own), so that no
    pass over the bytes follows the transfer; or moved before over bulk TCP or shared memory
    (`use`), and hashed there."""

    def __init__(
        self,
        header: pb.PublishHeader,
        shared_memory: SharedMemoryFiles | None = None,
        header_limits: dict[str, int] | None = None,
        arrivals: IncomingPublishes | None = None,
        counted: Callable[[Version], None] | None = None,
    ) -> None:
        self.header = header
        self.counted = counted  # called in the commit, before any reader can see the version
        self.shared_memory = shared_memory
        self.header_limits = header_limits
        self.arrivals = arrivals
        self.arriving: IncomingPublish | None = None  # announced to watchers as the bytes arrive
        self.transport = "stream"
        self.staged: StagedUpload | None = None
        self.moved = False  # `uploaded` came: the staged upload holds every byte
        self.upload: SharedMemoryUpload | None = None  # the buffer's file, removed unless committed
        self.buffer: memoryview | None = None  # allocated with the first chunk
        self.received = 0
        self.committed = False  # whether these bytes became a version (not so for a repeat)
        # None once the bytes turned out not to be a safetensors file: the store then checks
        # them from scratch, so that the error is the one it always gave (a wrong size or
        # digest before a bad header). Both start with the buffer, at the first chunk.
        self.digests: IncomingDigests | None = None
        self.sha256_feed: _Sha256Feed | None = None

    def add(self, chunk: bytes) -> None:
        if self.staged is not None:
            raise InvalidRequest(f"model {self.header.model!r}: chunks after `uploaded`; send one or the other")
        if self.buffer is None:
            self._allocate()
        end = self.received + len(chunk)
        if end > self.header.total_bytes:
            raise IntegrityError(
                f"model {self.header.model!r}: publisher declared {self.header.total_bytes} bytes but sent more"
            )
        self.buffer[self.received : end] = chunk
        self.received = end
        if self.arriving is not None:
            self.arriving.advance(end)
        if self.digests is None:
            return
        try:
            self.digests.advance(end)
        except InvalidSafetensors:
            self.digests = self.sha256_feed = None
            return
        if self.sha256_feed is not None:
            self.sha256_feed.advance(end)

    def written(self, message: pb.PublishWritten, uploads: StagedUploads, owner: bytes | None) -> None:
        """A shared-memory writer's progress: bytes [0, end) of its upload are in place, to be
        hashed while it writes the rest. The first such message takes the upload."""
        staged = self._own(message.upload, uploads, owner, "`written` after another upload or its `uploaded`")
        staged.written(message.end)
        self.received = message.end
        self.arriving = staged.arriving

    def uploaded(self, message: pb.PublishUploaded, uploads: StagedUploads, owner: bytes | None) -> None:
        """The model's bytes are all in the upload set up by Negotiate, instead of chunks (and
        its xxh3 comes here when the header was sent before they were moved)."""
        staged = self._own(message.upload, uploads, owner, "a model's bytes come as chunks or one `uploaded`")
        if message.xxh3:
            if self.header.xxh3 and self.header.xxh3.lower() != message.xxh3.lower():
                raise IntegrityError(
                    f"model {self.header.model!r}: header declares xxh3 {clipped_repr(self.header.xxh3)} but "
                    f"`uploaded` declares {clipped_repr(message.xxh3)}"
                )
            self.header.xxh3 = message.xxh3
        self.received, self.moved = self.header.total_bytes, True
        self.arriving = staged.arriving

    def _own(self, upload: str, uploads: StagedUploads, owner: bytes | None, out_of_order: str) -> StagedUpload:
        """The upload `upload`, taken from `uploads` by its first message (by `owner`, see
        `StagedUploads.take`); InvalidRequest (`out_of_order`) when the model's bytes came
        otherwise, or it is named after `uploaded`."""
        if self.staged is None:
            if self.received:
                raise InvalidRequest(f"model {self.header.model!r}: a model's bytes come as chunks or one `uploaded`")
            self.staged = uploads.take(upload, self.header.model, self.header.total_bytes, owner=owner)
            self.transport, self.upload, self.buffer = self.staged.transport, self.staged.file, self.staged.buffer
        elif upload != self.staged.id or self.moved:
            raise InvalidRequest(f"model {self.header.model!r}: {out_of_order}")
        return self.staged

    def _allocate(self) -> None:
        """The buffer for the chunks, and the digests that follow them into it."""
        size, header = self.header.total_bytes, self.header
        self.upload = self.shared_memory.new_upload(header.model, size) if self.shared_memory else None
        if self.upload is not None:
            self.buffer = self.upload.buffer
        else:
            # Anonymous memory is committed page by page as chunks arrive, so a header that claims
            # more than it sends reserves nothing (a bytearray would be zero-filled up front).
            self.buffer = memoryview(mmap.mmap(-1, size) if size else bytearray())
        self.digests = IncomingDigests(self.buffer, header_limits=self.header_limits)
        if self.arrivals is not None and size:
            self.arriving = self.arrivals.start(header.model, self.buffer)
        # sha256 for a header that declares one, or no xxh3 (the commit message then brings the
        # sha256); with only an xxh3 declared, the store computes it after the commit.
        self.sha256_feed = _Sha256Feed(self.buffer) if header.sha256 or not header.xxh3 else None

    def check_complete(self) -> None:
        if self.received != self.header.total_bytes:
            raise IntegrityError(
                f"model {self.header.model!r}: publisher declared {self.header.total_bytes} bytes but sent "
                f"{self.received}; the upload was cut short or the header is wrong"
            )

    async def as_upload(self, sha256: str | None) -> Upload:
        """The store's Upload of the received bytes, with their digests (once the sha256 thread,
        if any, has caught up; an upload a publisher wrote into shared memory is hashed now,
        in a thread) and the declared ones; one received into a shared-memory file brings the
        hook that makes the file its version's payload file."""
        digests = None
        if self.staged is not None:
            digests = await asyncio.to_thread(self.staged.finish)
        elif self.digests is not None:
            with contextlib.suppress(InvalidSafetensors):  # too short for a header: as above
                digests = self.digests.finish()
        if digests is not None and self.sha256_feed is not None:
            digests = dataclasses.replace(digests, sha256=await self.sha256_feed.hexdigest(self.received))
        return Upload(
            self.header.model,
            self.buffer if self.buffer is not None else memoryview(b""),
            sha256=sha256,
            total_bytes=self.header.total_bytes,
            metadata=dict(self.header.metadata),
            pin=self.header.pin,
            digests=digests,
            xxh3=self.header.xxh3 or None,
        )

    def _adopt(self, record: Version) -> None:
        """Phase 1 of the store's commit (durable, not yet visible, under the commit lock): a
        same-host fetch or a watcher that hears of the version finds its file and header in
        place, and no pin can change `record` in between."""
        self.committed = True
        if self.counted is not None:
            self.counted(record)
        if self.arriving is not None and self.arrivals is not None:
            self.arrivals.committed(self.arriving, record.model, record.version)
        if self.upload is None:
            return
        assert self.shared_memory is not None
        self.shared_memory.adopt((record.model, record.version, 0, ""), self.upload)
        self.shared_memory.write_header(
            record.model, record.version, lambda: wire.version_info(record).SerializeToString()
        )


class _Sha256Feed:
    """The sha256 of a buffer that fills front to back, computed in a thread of its own, batch
    by batch in order: it costs about 1 ms per MiB, too long for the event loop that receives
    the chunks, and the thread hashes while later chunks arrive. The thread ends with the
    digest, or when the feed is dropped."""

    def __init__(self, buffer: memoryview) -> None:
        self._buffer = buffer
        self._hasher = hashlib.sha256()
        self._fed = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightserver-publish-sha256")

    def advance(self, end: int, batch: int = SHA256_BATCH_BYTES) -> None:
        """Bytes [0, end) are in place: hand the new ones to the thread once `batch` are waiting."""
        if end - self._fed >= batch:
            self._thread.submit(self._hasher.update, self._buffer[self._fed : end])
            self._fed = end

    async def hexdigest(self, end: int) -> str:
        """The digest of bytes [0, end), once the thread has hashed them all."""
        self.advance(end, batch=1)
        try:
            return await asyncio.wrap_future(self._thread.submit(self._hasher.hexdigest))
        finally:
            self._thread.shutdown(wait=False)


def _check_publish(store: VersionStore, header: pb.PublishHeader, first: pb.PublishHeader) -> None:
    """The store's checks of one model's header before any byte comes; the version number and
    publish id are the group's, from its `first` header."""
    store.check_publish(
        header.model,
        total_bytes=header.total_bytes,
        version=first.version,
        metadata=header.metadata,
        publish_id=first.publish_id,
    )


def _check_group_header(first: pb.PublishHeader, header: pb.PublishHeader) -> None:
    if header.version and header.version != first.version:
        raise InvalidRequest(
            f"model {clipped_repr(header.model)}: a multi-model publish has one version number; this header asks for "
            f"{header.version} but the first asks for {first.version or 'the next one'} (leave later ones 0)"
        )
    if header.publish_id and header.publish_id != first.publish_id:
        raise InvalidRequest(
            f"model {header.model!r}: a multi-model publish has one publish id, the first header's; this "
            f"header gives {header.publish_id!r} (leave later ones empty)"
        )


def _declared_sha256s(incoming: list[_IncomingModel], commit: pb.PublishCommit) -> list[str | None]:
    """Each model's sha256 as declared in its header and/or the commit message; None for a
    model whose header declares only an xxh3."""
    from_commit = list(commit.sha256)
    if from_commit and len(from_commit) != len(incoming):
        raise InvalidRequest(
            f"the commit carries {len(from_commit)} sha256 digests for {len(incoming)} models; give one per header"
        )
    digests = []
    for i, model in enumerate(incoming):
        in_header, in_commit = model.header.sha256, from_commit[i] if from_commit else ""
        if not in_header and not in_commit and not model.header.xxh3:
            raise InvalidRequest(
                f"model {model.header.model!r}: give the xxh3 of the bytes in the header, or their sha256 in the "
                "header or the commit"
            )
        if in_header and in_commit and in_header.lower() != in_commit.lower():
            raise IntegrityError(
                f"model {model.header.model!r}: header declares sha256 {clipped_repr(in_header)} but the commit "
                f"declares {clipped_repr(in_commit)}"
            )
        digests.append(in_header or in_commit or None)
    return digests


def _log_event(event: str, context: grpc.aio.ServicerContext, **fields: object) -> None:
    """Log one line `<event> k=v ... peer=P client=C` (floats to 0.1) whose record also carries
    `event`, every field, `peer` and `client_id` as extra fields, for --log-format json."""
    peer, client_id = context.peer(), _client_id(context)
    pairs = " ".join(
        f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}" for key, value in fields.items()
    )
    extra = {"event": event, **fields, "peer": peer, "client_id": client_id}
    log.info("%s %s peer=%s client=%s", event, pairs, peer, client_id or "-", extra=extra)


def _owner(caller: Principal | None) -> bytes | None:
    """Who may name an upload `caller` sets up: its token (None without tokens: anyone)."""
    return caller.token_sha256 if caller is not None else None


def _hold_bucket(caller: Principal | None, context: grpc.aio.ServicerContext) -> str:
    """Whose bucket of waiting hold a publish draws on (commits_first): its token's, or with
    no tokens its host's (the peer address without its port)."""
    if caller is not None:
        return "token " + caller.token_sha256.hex()
    return "peer " + context.peer().rpartition(":")[0]


def _client_id(context: grpc.aio.ServicerContext) -> str | None:
    """The id the caller gave in the `weightserver-client-id` metadata, if any."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_METADATA_KEY:
            return str(value)
    return None
