"""A Watch call the server takes while it shuts down ends at once with UNAVAILABLE (after its
backlog), as the open ones do: before, it waited for an event that never came until the shutdown's
grace ran out, and gRPC then printed its cancellation (bench/chaos.py's final audit caught one: a
relay resubscribing just as the server was stopped)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save

from weightserver.metrics import NoMetrics
from weightserver.protocol.errors import ServerUnavailable
from weightserver.publish.incoming import IncomingPublishes
from weightserver.service.watch import Watches
from weightserver.storage.store import VersionStore
from weightserver.v1 import weights_pb2 as pb


class Context:
    """What a Watch call uses of grpc.aio's servicer context."""

    async def send_initial_metadata(self, metadata: object) -> None:
        pass

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple:
        return ()


async def events_until_it_ends(watches: Watches, since: int) -> tuple[list[int], BaseException | None]:
    seen: list[int] = []
    try:
        async with asyncio.timeout(2):  # the bug: a wait for an event that never comes
            async for event in watches.watch(pb.WatchRequest(model="m", since=since), Context()):
                seen.append(event.version.version)
    except (ServerUnavailable, TimeoutError) as exc:
        return seen, exc
    return seen, None


@pytest.mark.parametrize("since", [0, 2])
def test_a_watch_that_starts_once_the_server_is_stopping_ends_at_once(since):
    store = VersionStore()
    for value in (1.0, 2.0):
        store.publish("m", save({"w": torch.full((4,), value)}))
    watches = Watches(store, IncomingPublishes(), NoMetrics(), lambda: ())
    watches.end_all()  # the server began to shut down
    seen, ended = asyncio.run(events_until_it_ends(watches, since))
    assert seen == [1, 2][since:]  # the backlog, then the end
    assert isinstance(ended, ServerUnavailable), ended
