"""WeightServiceClient: the byte-level Python client of weightserver.v1.WeightService.

No torch (the CLI uses it; `WeightClient` adds tensors). How bytes move is the transports'
business; this module decides what to ask for, verifies what arrived and falls back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, TypeVar

from weightclient.core.connection import (
    PathLike,
    backoff_delay,
    call_metadata,
    open_channel,
    remaining,
    retry_unavailable,
)
from weightclient.core.latest_only_worker import LatestOnlyWorker
from weightclient.core.rpc_errors import translated_rpc_errors
from weightclient.core.server_link import ServerLinks, connector, parse_addresses
from weightclient.core.spare_uploads import SpareUploads
from weightclient.placement import Placement, checked_views
from weightclient.transports import (
    BulkTransport,
    Offer,
    OutgoingFile,
    PayloadGone,
    SharedMemoryTransport,
    StreamTransport,
    Transport,
    TransportChain,
    TransportFailed,
)
from weightclient.transports.base import Progress
from weightclient.transports.stream import OpenPublish
from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.errors import (
    DeadlineExceeded,
    IntegrityError,
    InvalidRequest,
    PublishAborted,
    ServerUnavailable,
    UploadNotFound,
)
from weightserver.protocol.limits import DEFAULT_CHUNK_BYTES, DEFAULT_PORT
from weightserver.protocol.version_info import Arriving, ModelSummary, VersionEvent, VersionInfo
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
SPARE_NEGOTIATE_SECONDS = 10.0  # a spare upload's Negotiate, in the background

ADDRESS_ENV = "WEIGHTSERVER_ADDRESS"
DEFAULT_ADDRESS = f"localhost:{DEFAULT_PORT}"

Buffer = bytes | bytearray | memoryview
_BUFFER_TYPES = (bytes, bytearray, memoryview)


def default_address() -> str:
    """`$WEIGHTSERVER_ADDRESS`, else localhost:50051."""
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


@dataclass(frozen=True)
class FetchStats:
    """How a fetch went: which transport carried it, payload bytes moved, wall time, whether
    it was read from the server's shared memory without asking the server first, and whether
    it was received while its publish was still arriving (cut-through; `seconds` then counts
    from the announcement)."""

    transport: str
    wire_bytes: int
    seconds: float
    direct: bool = False
    early: bool = False  # received while its publish was still arriving (cut-through)


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
            Several, comma-separated (e.g. "relay-a:50052,primary:50051", or a list): the first
            is used, and a call that finds its server down or stalled moves on to the next (see
            `server_link`); a server behind the version a caller holds is never gone back to.
        timeout: deadline in seconds for unary calls (describe, list, delete, pin).
        chunk_bytes: size of the chunks a publish sends and a fetch asks for.
        client_id: a name for this client in the server's logs (e.g. "collector-3").
        token: bearer token for servers started with --auth-tokens (default `$WEIGHTSERVER_TOKEN`).
        tls, tls_ca, tls_cert, tls_key: TLS (see `connection.open_channel`; default
            `$WEIGHTSERVER_TLS_CA` / _CERT / _KEY, plaintext when none is set).
        retry_seconds: idempotent calls (latest, describe, list, fetch, watch) retry while the
            server is unavailable, with backoff, for the call's timeout or else this long.
            Publish, delete and pin never retry here; a publish carries a `publish_id`, so
            retrying it with the same id commits it once.

    `transports` (a `TransportChain`) holds the transports and what this client learned of them.
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
        addresses = parse_addresses(address or default_address())
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.retry_seconds = retry_seconds
        self._metadata = call_metadata(token, client_id)
        self._shm = SharedMemoryTransport()
        channel = functools.partial(open_channel, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._links = ServerLinks(addresses, connector(channel, self._metadata, chunk_bytes, self._shm, _host_of))
        self._spares = SpareUploads(
            lambda request: self._stub.Negotiate(request, timeout=SPARE_NEGOTIATE_SECONDS, metadata=self._metadata)
        )
        self._reports = LatestOnlyWorker(self._report, "weightclient-fetch-reports")

    # The link in use: its address, channel, stub and transports (they change on `_move_on`).
    @property
    def address(self) -> str:
        """The address in use (the first of several given, until it failed)."""
        return self._links.current.address

    @property
    def addresses(self) -> list[str]:
        """Every address this client may use, in order."""
        return list(self._links.addresses)

    @property
    def transports(self) -> TransportChain:
        """The transports to the server in use, in order, and what this client learned of them."""
        return self._links.current.transports

    @transports.setter
    def transports(self, chain: TransportChain) -> None:
        self._links.current.transports = chain

    @property
    def _stub(self) -> pb_grpc.WeightServiceStub:
        return self._links.current.stub

    @property
    def _stream(self) -> StreamTransport:
        return self._links.current.stream

    @property
    def _bulk(self) -> BulkTransport:
        return self._links.current.bulk

    @property
    def _early_bulk(self) -> BulkTransport:
        return self._links.current.early_bulk

    def _move_on(self, failed: str, why: object) -> bool:
        """The server at `failed` is down or stalled: use the next address, if there is one."""
        return self._links.move_on(failed, why)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the server has heard of every fetch read directly from its shared memory
        (they are reported in the background); False on timeout."""
        return self._reports.flush(timeout)

    def close(self) -> None:
        """Close the channel (cancels running calls) and the bulk connection."""
        self._reports.close()
        self._spares.close()
        self._links.close()

    def __enter__(self) -> WeightServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
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
        publish_id: str | None = None,
        transport: str = "auto",
    ) -> VersionInfo:
        """Publish one safetensors file, given whole or as consecutive parts; return the version.

        `version` 0 lets the server assign latest + 1. The parts are sent without being joined
        first. `progress(sent, total)` is called as bytes go out. `publish_id`, `transport`:
        see `publish_group_bytes`.
        """
        return self.publish_group_bytes(
            {model: parts},
            version=version,
            metadata=metadata,
            pin=pin,
            sha256s={model: sha256},
            timeout=timeout,
            progress=progress,
            publish_id=publish_id,
            transport=transport,
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
        publish_id: str | None = None,
        transport: str = "auto",
    ) -> list[VersionInfo]:
        """Publish several models' safetensors files under ONE version number, committed
        together (no reader sees one model's new version beside another's old one). Returns
        each model's version, in `files` order. `progress(sent, total)` counts all models.

        `publish_id` names this logical publish (default: a new random id; "" sends none): the
        server commits a publish id once, so a retry with the same id after a lost reply gets
        the version the first attempt committed instead of a second one.

        `transport`, as for a fetch: "auto" (shared memory on the server's host, else bulk TCP,
        else the stream), "shm", "bulk" or "stream". Each model's bytes go over the transport
        Negotiate picks, falling back to the Publish stream (`TransportChain`); the Publish
        stream then commits them all.

        Each header declares the file's xxh3-128 (a tenth of sha256's CPU; a fast transport
        hashes while it moves the bytes); a sha256 given in `sha256s` is declared too. The
        server checks both and computes the version's sha256 itself after the commit when none
        was given, so `VersionInfo.sha256` in the reply may be "" (a fetch's header always
        carries it)."""
        if not files:
            raise InvalidRequest("publish needs at least one model")
        publish_id = uuid.uuid4().hex if publish_id is None else publish_id
        options = dict(version=version, metadata=metadata, pin=pin, sha256s=sha256s, progress=progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        spares, in_place = True, True
        while True:  # at most three attempts: each clears one of the two flags
            try:
                return self._publish_group(
                    files, publish_id, transport, deadline, spares=spares, in_place=in_place, **options
                )
            except UploadNotFound:
                # An upload set up ahead that the server no longer holds (it restarted): once
                # more, negotiating afresh. The same publish id: this cannot commit twice.
                if not spares:
                    raise
                log.info("the server forgot an upload set up ahead; publishing again without it")
                spares = False
            except _StartOver as exc:
                # Writing in place failed after the Publish call had begun (its header was
                # sent): that call was cancelled, committing nothing; the next attempt falls
                # back as a publish that writes nothing in place does.
                log.info("writing a publish in place failed (%s); publishing again", exc.__cause__)
                in_place = False

    def _publish_group(
        self,
        files: Mapping[str, Buffer | Sequence[Buffer]],
        publish_id: str,
        transport: str,
        deadline: float | None,
        *,
        spares: bool,
        in_place: bool = True,
        version: int,
        metadata: Mapping[str, str] | None,
        pin: bool,
        sha256s: Mapping[str, str | None] | None,
        progress: Progress | None,
    ) -> list[VersionInfo]:
        """One attempt. A model whose transport writes in place (shared memory) opens the
        Publish call before its bytes are written, when `in_place`: its header goes first, then
        word of how far the writing has got, so the server verifies them meanwhile."""
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        order = self.transports.order(transport)
        models = {
            model: [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, _BUFFER_TYPES) else parts)]
            for model, parts in files.items()
        }
        grand_total = sum(v.nbytes for views in models.values() for v in views)
        total = 0
        outgoing: list[OutgoingFile] = []
        call: OpenPublish | None = None  # opened early, for a model written in place

        def opened() -> OpenPublish:
            nonlocal call
            if call is None:
                call = self._stream.open_publish(timeout=remaining(deadline))
                for file in outgoing:
                    call.send_file(file)
            return call

        with translated_rpc_errors(self.address):
            try:
                for i, (model, views) in enumerate(models.items()):
                    header = pb.PublishHeader(
                        model=model,
                        version=version if i == 0 else 0,
                        metadata=meta,
                        total_bytes=sum(v.nbytes for v in views),
                        sha256=(sha256s or {}).get(model) or "",
                        pin=pin,
                        publish_id=publish_id if i == 0 else "",
                    )
                    counted = _shifted(progress, total, grand_total)
                    uploaded, carrier = self._upload(
                        header, views, order, deadline, counted, spares, opened if in_place else None
                    )
                    if not uploaded:
                        header.xxh3 = xxh3_hex(*views)
                    file = OutgoingFile(header, views, uploaded, carrier)
                    outgoing.append(file)
                    written_in_place = in_place and carrier is not None and carrier.written_in_place
                    if call is not None and not written_in_place:  # (that one sent its own messages)
                        call.send_file(file)
                    total += header.total_bytes
                if call is None:
                    reply = self._stream.send(outgoing, timeout=remaining(deadline), progress=progress)
                else:
                    reply = call.commit()
            except BaseException:
                if call is not None:
                    call.cancel()
                raise
        # Committed: set up each fast upload's successor while the trainer trains (not before:
        # on few cores it would slow this publish's commit down).
        for file in outgoing:
            if file.transport is not None:
                self._spares.refill(file.header.model, file.header.total_bytes, file.transport)
        return [VersionInfo.from_proto(v) for v in reply.versions] or [VersionInfo.from_proto(reply.version)]

    def _upload(
        self,
        header: pb.PublishHeader,
        views: Sequence[memoryview],
        order: list[Transport],
        deadline: float | None,
        progress: Progress | None,
        spares: bool = True,
        opened: Callable[[], OpenPublish] | None = None,
    ) -> tuple[str, Transport | None]:
        """Move one model's bytes over the fast transport the server picks from `order` (the
        next one when it fails here), and set the header's xxh3 from them: the upload's id and
        the transport, or ("", None) when the stream is to carry them. An upload set up ahead (`SpareUploads`) is used
        first. An upload that failed is left to expire on the server. A transport that writes
        in place, given `opened` (the Publish call, opened on first use), sends the model's
        messages itself (`_write_in_place`)."""
        model, size = header.model, header.total_bytes
        spare = self._spares.take(model, size, order) if size else None
        if spare is not None and not spares:
            spare.transport.release(spare.answer.payload)
            spare = None
        while order and size:
            if spare is not None:
                answer = spare.answer
            else:
                accept = [t.kind for t in order]
                negotiate = pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH, accept=accept, publish=header)
                answer = self._stub.Negotiate(negotiate, timeout=remaining(deadline), metadata=self._metadata)
                if answer.transport == pb.TRANSPORT_STREAM:
                    return "", None
            transport, spare = self.transports.by_kind[answer.transport], None
            if transport.written_in_place and opened is not None:
                self._write_in_place(opened(), header, answer, transport, views, deadline, progress)
                self.transports.worked(transport)
                return answer.upload, transport
            try:
                header.xxh3 = transport.upload(answer.payload, views, deadline=deadline, progress=progress)
            except TransportFailed as exc:
                self.transports.failed(transport, exc)
                order = [t for t in order if t is not transport]
                continue
            self.transports.worked(transport)
            return answer.upload, transport
        return "", None

    def _write_in_place(
        self,
        call: OpenPublish,
        header: pb.PublishHeader,
        answer: pb.NegotiateResponse,
        transport: Transport,
        views: Sequence[memoryview],
        deadline: float | None,
        progress: Progress | None,
    ) -> None:
        """Send the model's header, write its bytes into the upload telling the server every
        `_announce_step` bytes how far they are (it hashes them meanwhile), then name the
        upload with the xxh3 the writing computed. _StartOver when the transport fails here:
        the call is spoilt (the header is sent), so the publish starts again without it."""
        call.send(pb.PublishRequest(header=header))
        step, next_at = _announce_step(header.total_bytes), 0

        def announce(done: int, total: int) -> None:
            nonlocal next_at
            if done >= next_at + step and done < total:
                call.send(pb.PublishRequest(written=pb.PublishWritten(upload=answer.upload, end=done)))
                next_at = done
            if progress is not None:
                progress(done, total)

        try:
            xxh3 = transport.upload(answer.payload, views, deadline=deadline, progress=announce)
        except TransportFailed as exc:
            self.transports.failed(transport, exc)
            raise _StartOver() from exc
        header.xxh3 = xxh3
        call.send(pb.PublishRequest(uploaded=pb.PublishUploaded(upload=answer.upload, xxh3=xxh3)))

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

        `base_version`: a delta (only the tensors changed since); `dtype` ("BF16"/"F16"): float32
        tensors cast on the server. `transport`: "auto" (shared memory on this host, else bulk
        TCP, else the stream), "shm", "bulk" or "stream"; fast transports fall back to the
        stream (`TransportChain`). On the server's host an exact `version` is read from its
        shared memory without a call (`stats.direct`). Bytes are checked against the announced
        size and xxh3 (IntegrityError). `into`: a reused receive buffer the result then views.
        `base_xxh3`: the digest of the caller's copy of `base_version`; if the server's
        differs, the whole version is fetched. `place` (`placement.Placement`): a version's own
        file lands straight in the views it returns (`placed`). `retry=False` fails at once
        with ServerUnavailable. `progress(received, total)` follows the transfer.
        """
        request = _fetch_request(model, version, newer_than, self.chunk_bytes, base_version, dtype)
        deadline = None if timeout is None else time.monotonic() + timeout  # a refetch gets what is left

        def once(left: float | None) -> FetchedBytes | None:
            return self._fetch_once(request, self.transports.order(transport), left, into, place, progress)

        fetched = self._on_any_server(once, timeout, retry=retry)
        if fetched is not None and fetched.base_version and base_xxh3 and fetched.base_xxh3 != base_xxh3:
            log.info("%s v%d on the server differs from the caller's; fetching it whole", model, base_version)
            exact = _fetch_request(model, fetched.info.version, None, self.chunk_bytes, dtype=dtype)
            order = self.transports.order(transport)
            return self._fetch_once(exact, order, remaining(deadline), into, None, progress)
        return fetched

    def _fetch_once(
        self,
        request: pb.FetchRequest,
        order: list[Transport],
        timeout: float | None,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
    ) -> FetchedBytes | None:
        """One fetch: a direct read where possible, else a negotiated fast transport, else (or
        when that fails) the stream, which asks for the version the negotiation found."""
        started = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        exact = request.WhichOneof("selector") == "version" and not request.base_version and not request.dtype
        if exact and self._shm in order:
            offer, fetched = self._shm.read_directly(request.model, request.version), None
            if offer is not None:
                with contextlib.suppress(PayloadGone):  # evicted meanwhile: the server says what now
                    fetched = self._receive(self._shm, offer, started, into, place, progress)
            if fetched is not None:
                self._reports.put(request)
                return replace(fetched, stats=replace(fetched.stats, direct=True))
            order = [t for t in order if not self.transports.resting(t)]
        stream_request = request
        if order:
            negotiate = pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=[t.kind for t in order], fetch=request)
            with translated_rpc_errors(self.address):
                answer = self._stub.Negotiate(negotiate, timeout=timeout, metadata=self._metadata)
            if answer.HasField("up_to_date"):
                return None
            # If the fast transport fails, the stream brings exactly the version found.
            stream_request = _fetch_request(
                request.model, answer.header.version, None, self.chunk_bytes, request.base_version, request.dtype
            )
            if answer.transport != pb.TRANSPORT_STREAM:
                offer = Offer(VersionInfo.from_proto(answer.header), answer.payload, deadline=deadline)
                try:
                    fetched = self._receive(
                        self.transports.by_kind[answer.transport], offer, started, into, place, progress
                    )
                except PayloadGone as gone:
                    log.info("%s; asking again", gone)
                    fetched, stream_request = None, request
                if fetched is not None:
                    return fetched
        with translated_rpc_errors(self.address):
            offer = self._stream.open(stream_request, remaining(deadline))
            if offer is None:
                return None
            return self._receive(self._stream, offer, started, into, place, progress)

    def _receive(
        self,
        transport: Transport,
        offer: Offer,
        started: float,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
    ) -> FetchedBytes | None:
        """Receive `offer` over `transport` and verify it: every placed tensor against its
        digest, or the whole payload against its xxh3. None when a fast transport could not
        carry it or its bytes fail (recorded as its failure: the caller falls back; PayloadGone
        passes through, the caller asks again); the stream's bad bytes raise IntegrityError."""
        views = checked_views(place, offer.info) if place is not None and offer.whole_version else None
        fast = transport is not self._stream
        try:
            if views is not None:
                bad = transport.receive_placed(offer, views)
                data, problem = memoryview(b""), f"placed tensors {bad[:5]} do not match their digests" if bad else ""
            else:
                # A fast transport's progress is reported once, at the end (below).
                data = transport.receive(offer, into=into, progress=None if fast else progress)
                digest, announced = xxh3_hex(data), offer.payload.xxh3
                problem = f"xxh3 of the payload is {digest}, announced {announced}" if digest != announced else ""
            if problem and fast:
                raise TransportFailed(f"{offer.label}: {problem}")
        except PayloadGone:
            raise
        except TransportFailed as exc:
            self.transports.failed(transport, exc)
            return None
        if problem:
            raise IntegrityError(f"model {offer.label}: {problem}")
        if fast:
            self.transports.worked(transport)
            if progress is not None and views is None:
                progress(data.nbytes, data.nbytes)
        stats = FetchStats(transport.name, offer.payload.byte_size, time.perf_counter() - started)
        return FetchedBytes(
            offer.info,
            data,
            base_version=offer.payload.base_version,
            dtype=offer.payload.dtype,
            stats=stats,
            base_xxh3=offer.payload.base_xxh3,
            placed=views is not None,
        )

    def fetch_arriving(
        self,
        arriving: Arriving,
        *,
        transport: str = "auto",
        timeout: float | None = None,
        into: memoryview | None = None,
        progress: Progress | None = None,
    ) -> FetchedBytes:
        """The bytes of a publish still arriving at the server (cut-through), received as they
        land: over bulk TCP when `transport` allows it, else the Fetch stream. UNVERIFIED: the
        caller applies them only once the commit event names `arriving.id` and they match its
        xxh3 (`info` here is a stand-in with version 0). `progress(received, total)` follows
        the transfer. PublishAborted when the publish
        fails first; UploadNotFound once it has ended (fetch the committed version instead)."""
        started = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        request = pb.FetchRequest(model=arriving.model, incoming=arriving.id, chunk_size=self.chunk_bytes)
        placeholder = VersionInfo(arriving.model, 0, arriving.byte_size, "", datetime.now(timezone.utc))
        order = [t for t in self.transports.order(transport) if t is self._bulk]
        with translated_rpc_errors(self.address):
            if order:
                negotiate = pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_BULK], fetch=request)
                answer = self._stub.Negotiate(negotiate, timeout=timeout, metadata=self._metadata)
                if answer.transport == pb.TRANSPORT_BULK:
                    offer = Offer(placeholder, answer.payload, deadline=deadline)
                    try:
                        data = self._early_bulk.receive(offer, into=into, progress=progress)
                    except TransportFailed as exc:
                        # Cut short: the publish failed, or the connection did. Either way the
                        # commit event decides; the caller then fetches the version normally.
                        raise PublishAborted(
                            f"the bytes of {arriving.model!r} arriving were cut short ({exc})"
                        ) from exc
                    return FetchedBytes(placeholder, data, stats=self._early_stats("bulk", data, started))
            offer = self._stream.open_arriving(request, placeholder, remaining(deadline))
            data = self._stream.receive(offer, into=into, progress=progress)
        return FetchedBytes(placeholder, data, stats=self._early_stats("stream", data, started))

    @staticmethod
    def _early_stats(transport: str, data: memoryview, started: float) -> FetchStats:
        return FetchStats(transport, data.nbytes, time.perf_counter() - started, early=True)

    def _report(self, request: pb.FetchRequest) -> None:
        """Tell the server of a direct shared-memory read (its metrics and logs count it): the
        skipped Negotiate, made later by `_reports`, which keeps only the latest waiting. A
        thread, not `Negotiate.future()`: grpcio starts a thread per future (~0.8 ms)."""
        negotiate = pb.NegotiateRequest(
            direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_SHARED_MEMORY], fetch=request
        )
        self._stub.Negotiate(negotiate, timeout=self.timeout, metadata=self._metadata)

    # ------------------------------------------------------------------ watch
    def watch(
        self,
        model: str,
        *,
        since: int = 0,
        timeout: float | None = None,
        incoming: bool = False,
        on_subscribed: Callable[[dict[str, str]], None] | None = None,
    ) -> Iterator[VersionEvent | Arriving]:
        """Yield an event for every version of `model` committed after `since`, in order.

        Versions that landed before the call but after `since` (and are still retained) come
        first. The iterator runs until closed, the deadline passes, or the server stops.
        `incoming=True` also yields an `Arriving` as each publish's bytes begin to arrive
        (or fail), for cut-through (`fetch_arriving`). `on_subscribed(metadata)` is called with
        the server's initial metadata each time it takes the subscription (a relay names its
        primary there).
        """
        if since < 0:
            raise InvalidRequest(f"since must be >= 0 (a version number, 0 for all retained), got {since}")
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor, failures, outage_began = since, 0, 0.0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            request = pb.WatchRequest(model=model, since=cursor, incoming=incoming)
            address = self.address  # the server this stream goes to: the one to move on from
            stream = self._stub.Watch(request, timeout=left, metadata=self._metadata)
            try:
                with translated_rpc_errors(self.address):
                    if on_subscribed is not None:
                        metadata = dict(stream.initial_metadata() or ())
                        if not stream.done():  # else refused at once: the loop raises its error
                            on_subscribed(metadata)
                    for event in stream:
                        failures = 0
                        if not event.HasField("version"):
                            announced = event.incoming
                            yield Arriving(model, announced.id, announced.byte_size, failed=announced.failed)
                            continue
                        cursor = max(cursor, event.version.version)
                        info = VersionInfo.from_proto(event.version)
                        yield VersionEvent(info, gap=event.gap, arriving=event.incoming.id)
                return
            except ServerUnavailable as exc:
                # The server went away (restart, network): subscribe again from the last
                # version seen (on the next address, if there is one), so that nothing is
                # missed or repeated.
                now = time.monotonic()
                outage_began = now if failures == 0 else outage_began
                if now - outage_began >= self._retry_window(left):
                    raise
                if failures == 0:
                    log.warning("watch of %r at %s interrupted after v%d; resubscribing", model, self.address, cursor)
                moved = self._move_on(address, exc)
                if not (moved and failures == 0):  # the next address is asked at once, the first time
                    time.sleep(backoff_delay(failures))
                failures += 1
            finally:
                stream.cancel()

    # ------------------------------------------------------------------ describe and admin
    def latest(self, model: str, *, retry: bool = True, timeout: float | None = None) -> VersionInfo:
        """Describe the newest version of `model` (ModelNotFound if it has none). `retry=False`
        raises ServerUnavailable at once instead of waiting for the server to come back.
        `timeout`: this call's deadline instead of the client's."""
        request = pb.GetLatestRequest(model=model)
        return VersionInfo.from_proto(self._call("GetLatest", request, retry=retry, timeout=timeout))

    def describe(self, model: str, version: int = 0) -> VersionInfo:
        """Describe `version` of `model` (0: the latest)."""
        return VersionInfo.from_proto(self._call("Describe", pb.DescribeRequest(model=model, version=version)))

    def list_models(self) -> list[ModelSummary]:
        """Every model on the server, sorted by name."""
        reply = self._call("ListModels", pb.ListModelsRequest())
        return [ModelSummary.from_proto(m) for m in reply.models]

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Retained versions of `model`, oldest first."""
        reply = self._call("ListVersions", pb.ListVersionsRequest(model=model))
        return [VersionInfo.from_proto(v) for v in reply.versions]

    def delete(self, model: str, version: int) -> VersionInfo:
        """Delete one version from the server (and its data dir)."""
        reply = self._call("DeleteVersion", pb.DeleteVersionRequest(model=model, version=version), change=True)
        return VersionInfo.from_proto(reply.deleted)

    def pin(self, model: str, version: int, pinned: bool = True) -> VersionInfo:
        """Pin (keep beyond --keep) or unpin a version."""
        request = pb.PinVersionRequest(model=model, version=version, pinned=pinned)
        return VersionInfo.from_proto(self._call("PinVersion", request, change=True))

    def _call(
        self, method: str, request: object, *, retry: bool = True, timeout: float | None = None, change: bool = False
    ) -> Any:
        """A unary call by name, on the server in use when it starts. A `change` (delete, pin) is
        made once, on this server; others retry while no server answers (`retry`), or ask the
        next address once (not `retry`)."""

        def once(timeout: float | None) -> Any:
            with translated_rpc_errors(self.address):
                return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)

        seconds = self.timeout if timeout is None else timeout
        if change:
            return once(seconds)
        return self._on_any_server(once, seconds, retry=retry)

    def _on_any_server(self, call: Callable[[float | None], T], timeout: float | None, *, retry: bool) -> T:
        """`call(timeout)` on the server in use. When its server is down or stalled and there is
        another address: with `retry`, retried while no server answers (`retry_unavailable`,
        moving on from each that fails); without, once more on the next address."""
        used = [self.address]  # the address the latest attempt went to: the one to move on from

        def attempt(left: float | None) -> T:
            used[0] = self.address
            return call(left)

        def move_on(error: object) -> bool:
            return self._move_on(used[0], error)

        if retry:
            return retry_unavailable(attempt, self._retry_window(timeout), used[0], move_on=move_on)
        try:
            return attempt(timeout)
        except (ServerUnavailable, DeadlineExceeded) as exc:
            if not move_on(exc):
                raise
        # The next address gets a timeout of its own: one that stalled must not take the whole
        # budget from the failover (a collector's update then takes up to twice update_timeout).
        return attempt(timeout)

    def _retry_window(self, timeout: float | None) -> float:
        return timeout if timeout is not None else self.retry_seconds


class _StartOver(Exception):
    """A publish attempt that must be made again, falling back: raised from its TransportFailed."""


ANNOUNCE_MIN_BYTES = 4 << 20
ANNOUNCE_PARTS = 16


def _announce_step(total: int) -> int:
    """How many bytes a writer in place writes between two words to the server: about a
    sixteenth of the model (the server's last stretch to hash after the writing is that
    small), at least 4 MiB (each word costs both sides a message, and below that the
    overlap saves less than it costs: no gain measured at 16 MiB)."""
    return max(ANNOUNCE_MIN_BYTES, total // ANNOUNCE_PARTS)


def _shifted(progress: Progress | None, offset: int, total: int) -> Progress | None:
    """`progress` for one model of several: counts start at `offset` (the models before it)
    and go up to `total` (all of them)."""
    if progress is None:
        return None
    return lambda done, _: progress(offset + done, total)


def _fetch_request(
    model: str, version: int | None, newer_than: int | None, chunk_bytes: int, base_version: int = 0, dtype: str = ""
) -> pb.FetchRequest:
    if version is not None and newer_than is not None:
        raise InvalidRequest("give at most one of version= and newer_than=")
    if version is not None and version < 1:
        raise InvalidRequest(f"version must be >= 1, got {version}")
    if newer_than is not None and newer_than < 0:
        raise InvalidRequest(f"newer_than must be >= 0, got {newer_than}")
    selector = {"version": version, "newer_than": newer_than}  # None leaves a field unset
    return pb.FetchRequest(model=model, chunk_size=chunk_bytes, base_version=base_version, dtype=dtype, **selector)


def _host_of(address: str) -> str:
    """The host part of a gRPC target: 'localhost:50051' -> 'localhost', '[::1]:5' -> '::1'."""
    target = address.split("///", 1)[-1]
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host.strip("[]")
