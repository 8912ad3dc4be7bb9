"""Watching a model, resubscribing from the last version seen when the server goes away."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from weightclient.core.failover import Connection, map_rpc_errors
from weightclient.core.retry import Deadline
from weightserver.protocol.errors import InvalidRequest, ServerUnavailable
from weightserver.protocol.version_info import IncomingEvent, VersionEvent, VersionInfo
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)


class Watching(Connection):
    def watch(
        self,
        model: str,
        *,
        since: int = 0,
        timeout: float | None = None,
        incoming: bool = False,
        on_subscribed: Callable[[dict[str, str]], None] | None = None,
    ) -> Iterator[VersionEvent | IncomingEvent]:
        """An event per version committed after `since`; `incoming`: an `IncomingEvent` per publish too.
        `on_subscribed(metadata)`: each subscription's initial metadata (a relay names its primary)."""
        if since < 0:
            raise InvalidRequest(f"since must be >= 0 (a version number, 0 for all retained), got {since}")
        deadline = Deadline.after(timeout)
        cursor, failures, outage = since, 0, Deadline()
        while True:
            request = pb.WatchRequest(model=model, since=cursor, incoming=incoming)
            address = self.address  # the server this stream goes to: the one to move on from
            stream = self._link.stub.Watch(request, timeout=deadline.remaining(), metadata=self._metadata)
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
            except ServerUnavailable as exc:
                if failures == 0:
                    outage = deadline if deadline.at is not None else Deadline.after(self.retry_seconds)
                    log.warning("watch of %r at %s interrupted after v%d; resubscribing", model, address, cursor)
                if outage.expired():
                    raise
                if not (self._move_on(address, exc) and failures == 0) and not self.retry.wait(failures, outage):
                    raise
                failures += 1
            finally:
                stream.cancel()
