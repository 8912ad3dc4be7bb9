"""Watches: each Watch call's stream of version events, and of incoming publishes if asked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from weightserver.metrics import NoMetrics
from weightserver.protocol.errors import ServerUnavailable
from weightserver.protocol.names import validate_model_name
from weightserver.protocol.version_info import version_message
from weightserver.publish.incoming import IncomingPublish, IncomingPublishes
from weightserver.service.calls import Context, log_event
from weightserver.storage.store import Commit, Version, VersionStore
from weightserver.v1 import weights_pb2 as pb


@dataclass(eq=False)
class Watches:
    """The open Watch calls, ended with UNAVAILABLE at shutdown so that watchers resubscribe."""

    store: VersionStore
    announcements: IncomingPublishes
    metrics: NoMetrics
    metadata: Callable[[], Sequence[tuple[str, str]]]  # the initial metadata (a relay names its primary)
    _queues: set[asyncio.Queue[Version | pb.IncomingPublish | None]] = field(default_factory=set, init=False)
    _ended: bool = field(default=False, init=False)  # the server is shutting down: a Watch that starts now ends at once

    async def watch(self, request: pb.WatchRequest, context: Context) -> AsyncIterator[pb.VersionEvent]:
        model = validate_model_name(request.model)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Version | pb.IncomingPublish | None] = asyncio.Queue()  # None: the server stops

        def on_event(event: Version | IncomingPublish) -> None:
            if event.model == model:
                if isinstance(event, IncomingPublish):  # its state now (read later, a start could read as failed)
                    failed = event.failure is not None
                    event = pb.IncomingPublish(id=event.id, byte_size=event.byte_size, failed=failed)
                with contextlib.suppress(RuntimeError):  # loop closed: the server is shutting down
                    loop.call_soon_threadsafe(queue.put_nowait, event)

        def on_commit(commit: Commit) -> None:
            for record in commit.versions:
                on_event(record)

        # Subscribe before reading the backlog so no version can land between the two.
        unsubscribes = [self.store.subscribe(on_commit)]
        if request.incoming:
            unsubscribes.append(self.announcements.subscribe(on_event))
        self.metrics.watch_started(model)
        self._queues.add(queue)
        if self._ended:  # (a call the server took after `end_all`: else it would hold the shutdown's grace)
            queue.put_nowait(None)
        try:
            backlog, gap = self.store.versions_after(model, request.since)
            last = request.since
            await context.send_initial_metadata(self.metadata())
            log_event("watch", context, model=model, since=request.since, backlog=len(backlog))
            for record in backlog:
                yield self._event(record, gap, request.incoming)
                gap, last = False, record.version
            while True:
                event = await queue.get()
                if event is None:
                    raise ServerUnavailable("the server is shutting down; resubscribe with since=<last version seen>")
                if isinstance(event, pb.IncomingPublish):
                    yield pb.VersionEvent(incoming=event)
                    continue
                if event.version <= last:
                    continue
                # On the first live event after an empty backlog; on a relay, after missed versions.
                gap = gap or self.store.gap_between(model, last, event.version)
                yield self._event(event, gap, request.incoming)
                gap, last = False, event.version
        finally:
            self._queues.discard(queue)
            for unsubscribe in unsubscribes:
                unsubscribe()
            self.metrics.watch_ended(model)

    def _event(self, record: Version, gap: bool, incoming: bool) -> pb.VersionEvent:
        event = pb.VersionEvent(version=version_message(record), gap=gap)
        announced = self.announcements.id_of(record.model, record.version) if incoming else ""
        if announced:
            event.incoming.id, event.incoming.byte_size = announced, record.byte_size
        return event

    def end_all(self) -> None:
        self._ended = True
        for queue in self._queues:
            queue.put_nowait(None)
