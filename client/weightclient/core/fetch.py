"""Fetching a version's bytes: what to ask for, over which transport, verified, with fallback."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import xxhash

from weightclient.core.failover import Connection, map_rpc_errors
from weightclient.core.latest_only_worker import LatestOnlyWorker
from weightclient.core.retry import Deadline
from weightclient.placement import Placement, checked_views
from weightclient.transports import Offer, PayloadGone, Transport, TransportFailed
from weightclient.transports.base import Progress
from weightserver.protocol.errors import IntegrityError, InvalidRequest, PublishAborted
from weightserver.protocol.version_info import Arriving, VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchStats:
    """How a fetch went: its transport, payload bytes moved, wall time, whether it was read
    from the server's shared memory without a call (`direct`), and whether it was received
    while its publish was still incoming (cut-through; `seconds` then counts from then)."""

    transport: str
    wire_bytes: int
    seconds: float
    direct: bool = False
    early: bool = False  # received while its publish was still incoming


@dataclass(frozen=True)
class FetchedBytes:
    """A fetched version: its description and its verified payload (a safetensors file): the
    version's own file, or with `base_version` or `dtype` only the changed or cast tensors."""

    info: VersionInfo
    data: memoryview
    base_version: int = 0
    dtype: str = ""
    stats: FetchStats | None = None
    base_xxh3: str = ""  # the server's digest of the base version (deltas only)
    placed: bool = False  # the tensors went straight into the caller's views; `data` is empty


class Fetching(Connection):
    """The fetch half of `WeightServiceClient`."""

    @functools.cached_property
    def _reports(self) -> LatestOnlyWorker:
        return LatestOnlyWorker(self._report, "weightclient-fetch-reports")

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
        deadline: Deadline | None = None,
    ) -> FetchedBytes | None:
        """The latest version's bytes, exactly `version`, or the latest only if newer than
        `newer_than` (None when it is not: nothing moves).

        `base_version`: a delta (only the tensors changed since); `dtype` ("BF16"/"F16"):
        float32 tensors cast on the server. `transport`: "auto" (shared memory on this host,
        else bulk TCP, else the stream), "shm", "bulk" or "stream"; each falls back to the
        next. On the server's host an exact `version` is read from its shared memory without a
        call (`stats.direct`). Bytes are checked against their xxh3 (IntegrityError). `into`:
        a reused receive buffer. `base_xxh3`: the caller's digest of `base_version`; if the
        server's differs, the whole version is fetched, within what is left of the deadline.
        `place`: a version's own file lands in the views it returns (`placed`). `retry=False`
        fails at once with ServerUnavailable. `deadline` (instead of `timeout`): a caller's
        deadline carried down.
        """
        request = _fetch_request(model, version, newer_than, self.chunk_bytes, base_version, dtype)
        deadline = deadline or Deadline.after(timeout)

        def once(within: Deadline) -> FetchedBytes | None:
            return self._fetch_once(request, self.transports.order(transport), within, into, place, progress)

        fetched = self._on_any_server(once, deadline, retry=retry)
        if fetched is not None and fetched.base_version and base_xxh3 and fetched.base_xxh3 != base_xxh3:
            log.info("%s v%d on the server differs from the caller's; fetching it whole", model, base_version)
            request = _fetch_request(model, fetched.info.version, None, self.chunk_bytes, dtype=dtype)
            return self._fetch_once(request, self.transports.order(transport), deadline, into, None, progress)
        return fetched

    def _fetch_once(
        self,
        request: pb.FetchRequest,
        order: list[Transport],
        deadline: Deadline,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
    ) -> FetchedBytes | None:
        """One fetch: a direct read where possible, else over the transport the server picks
        from `order`, falling back along it; once the server named a version, the next
        transport asks for exactly that one."""
        started = time.perf_counter()
        exact = request.WhichOneof("selector") == "version" and not request.base_version and not request.dtype
        if exact and self._shm in order:
            offer, fetched = self._shm.read_directly(request.model, request.version), None
            try:
                if offer is not None:
                    fetched = self._receive(self._shm, offer, started, into, place, progress, last=False)
            except PayloadGone:
                pass  # evicted meanwhile: the server says what now
            except TransportFailed as exc:
                self.transports.failed(self._shm, exc)
            if fetched is not None:
                self._reports.put(request)
                return replace(fetched, stats=replace(fetched.stats, direct=True))
            order = [t for t in order if not self.transports.resting(t)]
        asked = request
        with map_rpc_errors(self.address):
            while True:
                transport, offer = self._offer(request, order, deadline)
                if offer is None:
                    return None
                request = _fetch_request(
                    request.model, offer.info.version, None, self.chunk_bytes, request.base_version, request.dtype
                )
                try:
                    return self._receive(transport, offer, started, into, place, progress, last=transport is order[-1])
                except PayloadGone as gone:
                    log.info("%s; asking again", gone)
                    request = asked
                except TransportFailed as exc:
                    self.transports.failed(transport, exc)
                order = order[-1:]  # the stream, which every server offers

    def _offer(
        self, request: pb.FetchRequest, order: list[Transport], deadline: Deadline, info: VersionInfo | None = None
    ) -> tuple[Transport, Offer | None]:
        """The transport of `order` that carries `request`, and its offer: the server picks
        (Negotiate) when there is a choice, else the only one opens its own."""
        answer = None
        if len(order) > 1:
            accept = [t.kind for t in order]
            negotiate = pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=accept, fetch=request)
            answer = self._stub.Negotiate(negotiate, timeout=deadline.remaining(), metadata=self._metadata)
            if answer.HasField("up_to_date"):
                return order[-1], None
        transport = next(t for t in order if answer is None or t.kind == answer.transport)
        return transport, transport.offer(request, answer, deadline, info)

    def _receive(
        self,
        transport: Transport,
        offer: Offer,
        started: float,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
        *,
        last: bool,
    ) -> FetchedBytes:
        """Receive `offer` over `transport` and verify it: each placed tensor against its
        digest, or the payload against its xxh3. Bad bytes are TransportFailed (fall back), or,
        with no transport left (`last`), IntegrityError. Progress goes to the last transport as
        bytes come; others report once verified, since their bytes may yet be dropped."""
        views = checked_views(place, offer.info) if place is not None and offer.whole_version else None
        if views is not None:
            bad = transport.receive_placed(offer, views)
            data, problem = memoryview(b""), f"placed tensors {bad[:5]} do not match their digests" if bad else ""
        else:
            data = transport.receive(offer, into=into, progress=progress if last else None)
            digest, announced = xxhash.xxh3_128_hexdigest(data), offer.payload.xxh3
            problem = f"xxh3 of the payload is {digest}, announced {announced}" if digest != announced else ""
        if problem:
            raise (IntegrityError if last else TransportFailed)(f"model {offer.label}: {problem}")
        self.transports.worked(transport)
        if progress is not None and views is None and not last:
            progress(data.nbytes, data.nbytes)
        return FetchedBytes(
            offer.info,
            data,
            base_version=offer.payload.base_version,
            dtype=offer.payload.dtype,
            stats=FetchStats(transport.name, offer.payload.byte_size, time.perf_counter() - started),
            base_xxh3=offer.payload.base_xxh3,
            placed=views is not None,
        )

    def fetch_incoming(
        self,
        incoming: Arriving,
        *,
        transport: str = "auto",
        timeout: float | None = None,
        into: memoryview | None = None,
        progress: Progress | None = None,
    ) -> FetchedBytes:
        """The bytes of a publish still incoming at the server (cut-through), received as they
        land, over bulk TCP when `transport` allows, else the Fetch stream. UNVERIFIED: apply
        them only once the commit event names `incoming.id` and they match its xxh3 (`info` is
        a stand-in, version 0). PublishAborted when the publish fails first; UploadNotFound
        once it has ended (fetch the committed version instead)."""
        started, deadline = time.perf_counter(), Deadline.after(timeout)
        request = pb.FetchRequest(model=incoming.model, incoming=incoming.id, chunk_size=self.chunk_bytes)
        placeholder = VersionInfo(incoming.model, 0, incoming.byte_size, "", datetime.now(timezone.utc))
        bulk = self.transports.by_name.get("bulk")
        order = [self._link.incoming_bulk, self.transports.stream]
        if bulk not in self.transports.order(transport):
            order = order[1:]
        with map_rpc_errors(self.address):
            carrier, offer = self._offer(request, order, deadline, placeholder)
            assert offer is not None, "incoming bytes are never up to date"
            try:
                data = carrier.receive(offer, into=into, progress=progress)
            except TransportFailed as exc:  # cut short: the commit event decides, else a fetch
                raise PublishAborted(f"the incoming bytes of {incoming.model!r} were cut short ({exc})") from exc
        stats = FetchStats(carrier.name, data.nbytes, time.perf_counter() - started, early=True)
        return FetchedBytes(placeholder, data, stats=stats)

    def _report(self, request: pb.FetchRequest) -> None:
        """Tell the server of a direct shared-memory read (its metrics count it): the skipped
        Negotiate, later, in `_reports`' thread (grpcio starts a thread per future)."""
        accept = [pb.TRANSPORT_SHARED_MEMORY]
        negotiate = pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=accept, fetch=request)
        self._stub.Negotiate(negotiate, timeout=self.timeout, metadata=self._metadata)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the server has heard of every direct read; False on timeout."""
        return self._reports.flush(timeout)

    def close(self) -> None:
        self._reports.close()
        super().close()


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
