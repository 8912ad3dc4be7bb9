"""The events of a Watch call (weightserver.service.watch), on the servicer's side."""

from __future__ import annotations

import asyncio

from weightserver.metrics import NoMetrics
from weightserver.publish.incoming import IncomingPublishes
from weightserver.service.watch import Watches
from weightserver.storage.store import VersionStore
from weightserver.v1 import weights_pb2 as pb


class Context:
    """What a Watch call uses of grpc.aio's servicer context; `subscribed` is set once it listens."""

    def __init__(self) -> None:
        self.subscribed = asyncio.Event()

    async def send_initial_metadata(self, metadata: object) -> None:
        self.subscribed.set()  # (the Watch subscribes before it sends its initial metadata)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple:
        return ()


def test_a_publish_that_fails_before_the_watcher_reads_its_start_is_announced_then_failed():
    """A publish whose bytes began to arrive and which failed before the Watch sent its first
    announcement is told as it happened: started, then failed, once each. Before, both events were
    made from the publish's state when sent, so the watcher got `failed` twice and never the start."""

    async def events() -> list[tuple[str, bool]]:
        announcements, context = IncomingPublishes(), Context()
        watches = Watches(VersionStore(), announcements, NoMetrics(), lambda: ())
        request = pb.WatchRequest(model="m", incoming=True)
        async with asyncio.timeout(5):
            stream = watches.watch(request, context)
            first = asyncio.ensure_future(anext(stream))
            await context.subscribed.wait()
            incoming = announcements.start("m", memoryview(bytearray(64)))
            incoming.fail("the publisher was cut off")
            seen = [(await first).incoming, (await anext(stream)).incoming]
            await stream.aclose()
        assert {event.id for event in seen} == {incoming.id}
        return [(event.id, event.failed) for event in seen]

    (started, ended) = asyncio.run(events())
    assert (started[1], ended[1]) == (False, True)
