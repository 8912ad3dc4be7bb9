"""Fetching a version's bytes: what to ask for, over which transport, verified, with fallback."""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import xxhash

from weightclient.core.background import LatestOnlyWorker
from weightclient.core.failover import Connection, map_rpc_errors
from weightclient.core.retry import Deadline
from weightclient.placement import Placement, checked_views
from weightclient.transports import PayloadGone, TransportFailed
from weightclient.transports.base import Offer, Progress
from weightserver.protocol import deltas
from weightserver.protocol.errors import DeadlineExceeded, IntegrityError, InvalidRequest, PublishAborted
from weightserver.protocol.limits import version_number
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.selection import Selection
from weightserver.protocol.version_info import IncomingEvent, VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchStats:
    """`direct`: read from shared memory without a call; `incoming`: received by cut-through."""

    transport: str
    wire_bytes: int
    seconds: float
    direct: bool = False
    incoming: bool = False


@dataclass(frozen=True)
class FetchedBytes:
    """A version and its verified payload: its file, or the changed or cast tensors only."""

    info: VersionInfo
    data: memoryview
    base_version: int = 0
    dtype: str = ""
    stats: FetchStats | None = None
    base_xxh3: str = ""  # the server's digest of the base version (deltas only)
    placed: bool = False  # the tensors went straight into the caller's views; `data` is empty
    changed: tuple[str, ...] | None = None  # a delta rebuilt on the base's bytes: `data` is the version


class Fetching(Connection):
    @functools.cached_property
    def _reports(self) -> LatestOnlyWorker:
        """Tells the server of direct reads (for its metrics), the newest waiting only."""
        return LatestOnlyWorker(
            lambda request: self._negotiate(self.timeout, [pb.TRANSPORT_SHARED_MEMORY], fetch=request),
            "weightclient-fetch-reports",
        )

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
        base_bytes: deltas.Bytes | None = None,
        consume_base: bool = False,
        select: Selection | str | Iterable[str] | None = None,
        stall: float = 0.0,
    ) -> FetchedBytes | None:
        """The latest version, exactly `version`, or the latest if newer than `newer_than` (else None).
        `base_version`: changed tensors only; `dtype`: float32 cast by the server; `base_xxh3`: the caller's digest of
        the base (if the server's differs, the whole version is fetched); `base_bytes`: the base's file, so changed
        tensors may come as changed elements, rebuilt as they arrive on a copy of it (in it with `consume_base`):
        `data` is then the version, unverified, and `changed` names the tensors the delta carried (a base laid out
        otherwise gets the delta as it is). `select`: only these tensors or slices (a Selection, or glob patterns);
        `info` then describes the selection's file under the version's number, and a delta is against the same
        selection of the base. `stall`: the deadline bounds finding the version and starting its transfer, which
        then runs while its bytes keep coming, each wait for them at most `stall` seconds."""
        if version is not None and newer_than is not None:
            raise InvalidRequest(f"give version or newer_than, not both: {version=}, {newer_than=}")
        if version is not None:
            version = version_number(version, "version", least=1, meaning="leave it unset for the latest")
        if newer_than is not None:
            newer_than = version_number(newer_than, "newer_than", meaning="0: any version")
        base_version = version_number(base_version, "base_version", meaning="0: none, the whole version")
        request = pb.FetchRequest(model=model, version=version, newer_than=newer_than, chunk_size=self.chunk_bytes)
        request.base_version, request.dtype = base_version, dtype  # (a None above leaves its field unset)
        if select is not None:
            request.select.CopyFrom(Selection.of(select).message())
        rebuild_on = None
        if base_bytes is not None and base_version and not dtype:
            request.element_deltas.extend(deltas.WIRE.values())

            def rebuild_on(offer: Offer) -> deltas.Rebuild | None:  # (only for an offer of a delta)
                info, size, header = offer.info, offer.payload.byte_size, parse_header(base_bytes)
                if base_xxh3 and offer.payload.base_xxh3 != base_xxh3:
                    return None  # a delta on another base: fetched whole next, below
                return deltas.Rebuild.on(base_bytes, header, info.tensors, info.byte_size, size, in_place=consume_base)

        deadline = deadline or self._deadline(timeout)
        once = functools.partial(self._fetch_once, request, transport, into, place, progress, rebuild_on, stall=stall)
        fetched = self._on_any_server(once, deadline, retry=retry)
        if fetched is not None and fetched.base_version and base_xxh3 and fetched.base_xxh3 != base_xxh3:
            log.info("%s v%d on the server differs from the caller's; fetching it whole", model, base_version)
            whole = pb.FetchRequest(model=model, version=fetched.info.version, chunk_size=self.chunk_bytes, dtype=dtype)
            if request.HasField("select"):
                whole.select.CopyFrom(request.select)
            return self._fetch_once(whole, transport, into, None, progress, None, deadline, stall=stall)
        return fetched

    def _fetch_once(
        self,
        request: pb.FetchRequest,
        choice: str,
        into: memoryview | None,
        place: Placement | None,
        progress: Progress | None,
        rebuild_on: Callable[[Offer], deltas.Rebuild | None] | None,
        deadline: Deadline,
        stall: float = 0.0,
    ) -> FetchedBytes | None:
        """A direct read, else the transport the server picks, falling back to the stream for the version named.
        IntegrityError: bad bytes from the last transport, or a delta that arrived as sent but does not rebuild."""
        started, order, asked = time.perf_counter(), self.transports.order(choice), request
        transport, offer = self._shm, None
        exact = request.WhichOneof("selector") == "version" and not request.base_version and not request.dtype
        exact = exact and not request.HasField("select")  # a direct read is of the whole version
        if exact and self._shm in order:
            offer = self._shm.read_directly(request.model, request.version)
            if offer is None:
                order = [t for t in order if not self.transports.resting(t)]
        direct = offer is not None
        with map_rpc_errors(self.address):
            while True:
                if offer is None:
                    answer = None
                    if len(order) > 1:
                        answer = self._negotiate(deadline.remaining(), [t.kind for t in order], fetch=request)
                        if answer.HasField("up_to_date"):
                            return None
                    transport = next(t for t in order if answer is None or t.kind == answer.transport)
                    offer = transport.offer(request, answer, deadline, None, stall=stall)
                    if offer is None:
                        return None
                    offer = _selected(offer, request)
                    request = copy.deepcopy(asked)
                    request.version = offer.info.version  # the one named, whatever `asked` selected
                last = transport is order[-1] and not direct
                views = checked_views(place, offer.info) if place is not None and offer.whole_version else None
                delta = bool(offer.payload.base_version)
                rebuild = rebuild_on(offer) if rebuild_on is not None and delta else None
                try:
                    if views is not None:
                        data, bad = memoryview(b""), transport.receive_placed(offer, views)
                        problem = f"placed tensors {bad[:5]} do not match their digests" if bad else ""
                    elif rebuild is not None:
                        data = transport.receive(offer, into=rebuild, progress=progress if last else None)
                        digest, announced = rebuild.xxh3(), offer.payload.xxh3
                        problem = f"xxh3 of the delta is {digest}, announced {announced}" if digest != announced else ""
                        if rebuild.problem and not problem:
                            raise IntegrityError(f"model {offer.label}: {rebuild.problem}")
                        data = rebuild.rebuilt
                    else:
                        # A delta on a base laid out otherwise must not land in `into`, which may be that base.
                        target = None if delta and request.element_deltas else into
                        data = transport.receive(offer, into=target, progress=progress if last else None)
                        problem = ""
                        if not transport.sealed(data):  # (a sealed file is the version: nothing to check)
                            digest, announced = xxhash.xxh3_128_hexdigest(data), offer.payload.xxh3
                            if digest != announced:
                                problem = f"xxh3 of the payload is {digest}, announced {announced}"
                    if problem:
                        raise (IntegrityError if last else TransportFailed)(f"model {offer.label}: {problem}")
                except PayloadGone as gone:
                    log.info("%s; asking again", gone)
                    request = asked
                except TransportFailed as exc:
                    self.transports.failed(transport, exc)
                else:
                    self.transports.worked(transport)
                    if progress is not None and views is None and not last:
                        progress(data.nbytes, data.nbytes)
                    if direct:
                        self._reports.put(request)
                    p = offer.payload
                    stats = FetchStats(transport.name, p.byte_size, time.perf_counter() - started, direct)
                    changed = tuple(rebuild.changed) if rebuild is not None else None
                    return FetchedBytes(
                        offer.info, data, p.base_version, p.dtype, stats, p.base_xxh3, views is not None, changed
                    )
                order = [t for t in order if not self.transports.resting(t)] if direct else order[-1:]
                offer, direct = None, False

    def fetch_incoming(
        self,
        incoming: IncomingEvent,
        *,
        transport: str = "auto",
        timeout: float | None = None,
        into: memoryview | None = None,
        progress: Progress | None = None,
    ) -> FetchedBytes:
        """The bytes of a publish still arriving, over bulk when `transport` allows. UNVERIFIED: apply them only once
        the commit event names `incoming.id` and they match its xxh3. `timeout` bounds each wait for bytes."""
        stall = self.timeout if timeout is None else timeout  # the set-up's deadline, then each wait for bytes
        started, deadline = time.perf_counter(), Deadline.after(stall)
        request = pb.FetchRequest(model=incoming.model, incoming=incoming.id, chunk_size=self.chunk_bytes)
        placeholder = VersionInfo(incoming.model, 0, incoming.byte_size, "", datetime.now(UTC))
        carrier, answer = self.transports.stream, None
        with map_rpc_errors(self.address):
            if self.transports.by_name.get("bulk") in self.transports.order(transport):
                answer = self._negotiate(deadline.remaining(), [pb.TRANSPORT_BULK, pb.TRANSPORT_STREAM], fetch=request)
                if answer.transport == pb.TRANSPORT_BULK:
                    carrier = self._link.incoming_bulk
            try:
                offer = carrier.offer(request, answer, deadline, placeholder, stall=stall or 0.0)
                assert offer is not None, "incoming bytes are never up to date"
                data = carrier.receive(offer, into=into, progress=progress)
            except (TransportFailed, DeadlineExceeded) as exc:  # cut short, or stalled: the commit event decides
                raise PublishAborted(f"the incoming bytes of {incoming.model!r} were cut short ({exc})") from exc
        stats = FetchStats(carrier.name, data.nbytes, time.perf_counter() - started, incoming=True)
        return FetchedBytes(placeholder, data, stats=stats)

    def flush(self, timeout: float | None = None) -> bool:
        return self._reports.flush(timeout)

    def close(self) -> None:
        self._reports.close()
        super().close()


def _selected(offer: Offer, request: pb.FetchRequest) -> Offer:
    """With a selection, `offer` described as the selection's file, which its bytes are checked against."""
    if not request.HasField("select"):
        return offer
    if not offer.payload.HasField("selection"):
        raise IntegrityError(f"model {offer.label}: the server sent no selection description (it predates selections)")
    return replace(offer, info=offer.info.selected(offer.payload.selection))
