"""WeightServiceClient: the byte-level client (no torch; the CLI and the relay use it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from weightclient.core.failover import default_address, map_rpc_errors
from weightclient.core.fetch import FetchedBytes, Fetching, FetchStats
from weightclient.core.publish import Publishing
from weightclient.core.retry import Deadline
from weightserver.protocol.errors import Cancelled, ServerUnavailable
from weightserver.protocol.limits import version_number
from weightserver.protocol.version_info import IncomingEvent, ModelSummary, VersionEvent, VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["FetchStats", "FetchedBytes", "WatchStream", "WeightServiceClient", "default_address"]

WatchEvent = VersionEvent | IncomingEvent


class _Cancellation:
    """A watch's cancel: `requested`, and the gRPC call under way cancelled (from any thread)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None

    def cancel(self) -> None:
        with self._lock:
            self.requested.set()
            call = self._call
        if call is not None:
            call.cancel()

    def calling(self, call: Any) -> None:
        """`call` is the one under way now (cancelled at once if the watch was)."""
        with self._lock:
            self._call = call
        if self.requested.is_set():
            call.cancel()


class WatchStream(Iterator[WatchEvent]):
    """What `watch` returns: its events, in order. `cancel()`, from any thread, ends it at once and quietly (no error,
    no resubscription); `close()`, like a generator's, only from the thread that steps it."""

    def __init__(self, events: Callable[[_Cancellation], Iterator[WatchEvent]]) -> None:
        self._cancellation = _Cancellation()
        self._events = events(self._cancellation)  # (holds the cancellation, not this: dropping this ends it)

    def __next__(self) -> WatchEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()  # type: ignore[attr-defined]

    def cancel(self) -> None:
        self._cancellation.cancel()


class WeightServiceClient(Publishing, Fetching):
    """Publish, fetch, watch, describe and manage safetensors bytes. Arguments: `Connection`."""

    def latest(self, model: str, *, retry: bool = True, timeout: float | None = None) -> VersionInfo:
        request = pb.GetLatestRequest(model=model)
        return VersionInfo.from_proto(self._call("GetLatest", request, retry=retry, timeout=timeout))

    def describe(self, model: str, version: int = 0) -> VersionInfo:
        """`version` of `model` (0: the latest)."""
        request = pb.DescribeRequest(model=model, version=version_number(version, "version", meaning="0: the latest"))
        return VersionInfo.from_proto(self._call("Describe", request))

    def list_models(self) -> list[ModelSummary]:
        return [ModelSummary.from_proto(m) for m in self._call("ListModels", pb.ListModelsRequest()).models]

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Retained versions of `model`, oldest first."""
        reply = self._call("ListVersions", pb.ListVersionsRequest(model=model))
        return [VersionInfo.from_proto(v) for v in reply.versions]

    def delete(self, model: str, version: int) -> VersionInfo:
        request = pb.DeleteVersionRequest(model=model, version=version_number(version, "version"))
        return VersionInfo.from_proto(self._call("DeleteVersion", request, change=True).deleted)

    def pin(self, model: str, version: int, pinned: bool = True) -> VersionInfo:
        """Pin (keep beyond --keep) or unpin a version."""
        request = pb.PinVersionRequest(model=model, version=version_number(version, "version"), pinned=pinned)
        return VersionInfo.from_proto(self._call("PinVersion", request, change=True))

    def watch(
        self,
        model: str,
        *,
        since: int = 0,
        timeout: float | None = None,
        incoming: bool = False,
        on_subscribed: Callable[[dict[str, str]], None] | None = None,
    ) -> WatchStream:
        """An event per version committed after `since`; `incoming`: an `IncomingEvent` per publish too.
        `on_subscribed(metadata)`: each subscription's initial metadata (a relay names its primary). Once a server
        goes away or the client moves on from it, the server in use is resubscribed to from the last version seen."""
        since = version_number(since, "since", meaning="0: every retained version")  # here, not at the first step

        def events(cancellation: _Cancellation) -> Iterator[WatchEvent]:
            deadline = Deadline.after(timeout)
            cursor, failures, outage = since, 0, Deadline()
            while not cancellation.requested.is_set():
                request = pb.WatchRequest(model=model, since=cursor, incoming=incoming)
                link = self._link  # the server this stream goes to: the one to move on from
                address = link.address
                stream = link.stub.Watch(request, timeout=deadline.remaining(), metadata=self._metadata)
                cancellation.calling(stream)
                try:
                    with map_rpc_errors(address):
                        if on_subscribed is not None:
                            metadata = dict(stream.initial_metadata() or ())
                            if not stream.done():  # else refused at once: the loop raises its error
                                on_subscribed(metadata)
                        for event in stream:
                            failures = 0
                            if event.HasField("version"):
                                cursor = max(cursor, event.version.version)
                                info = VersionInfo.from_proto(event.version)
                                yield VersionEvent(info, gap=event.gap, incoming=event.incoming.id)
                            else:
                                announced = event.incoming
                                yield IncomingEvent(model, announced.id, announced.byte_size, failed=announced.failed)
                    return
                except Cancelled:
                    if cancellation.requested.is_set():
                        return
                    if link is self._link:
                        raise  # by the caller, or the client was closed
                    # A link the client moved on from (a fetch's failover) is closed after RETIRED_LINKS more moves.
                    log.info("watch of %r at %s ended with its link; resubscribing at %s", model, address, self.address)
                except ServerUnavailable as exc:
                    if cancellation.requested.is_set():
                        return
                    if failures == 0:
                        outage = deadline if deadline.at is not None else Deadline.after(self.retry_seconds)
                        log.warning("watch of %r at %s interrupted after v%d; resubscribing", model, address, cursor)
                    if outage.expired():
                        raise
                    moved = self._move_on(address, exc) and failures == 0
                    if not moved and not self.retry.wait(failures, outage, wake=cancellation.requested):
                        raise  # (the wait ends once the watch is cancelled: the loop then ends)
                    failures += 1
                finally:
                    stream.cancel()

        return WatchStream(events)
