"""StreamTransport: payloads as chunk messages of the Fetch call itself.

At most `--max-stream-fetches` send at a time, so a publish shares the loop with a few fetches,
not every open one; and each chunk waits while a publish goes first (`CommitsFirst`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence

from weightserver.protocol import framing
from weightserver.protocol.errors import PublishAborted
from weightserver.publish.incoming import IncomingPublish
from weightserver.publish.priority import CommitsFirst

SLOW_READER_SECONDS = 1.0  # a write pending this long gives the fetch's turn back
INCOMING_STALL_SECONDS = 60.0  # a fetch of a publish's bytes as they land gives up when none land for this long


class StreamTransport:
    """The fallback every server has: no transport of Negotiate's, the Fetch call sends the chunks."""

    def __init__(self, max_fetches: int, commits_first: CommitsFirst) -> None:
        self._turns = asyncio.Semaphore(max_fetches)
        self._commits_first = commits_first

    async def send(self, parts: Sequence[memoryview], chunk_bytes: int) -> AsyncIterator[bytes]:
        """A payload's consecutive `parts` (`Payload.parts`) as chunk messages."""
        loop = asyncio.get_running_loop()
        await self._turns.acquire()
        give_back = functools.cache(self._turns.release)  # once: at a slow reader's write or at the end
        try:
            for message in framing.chunk_messages(parts, chunk_bytes):
                await self._commits_first.wait()
                slow = loop.call_later(SLOW_READER_SECONDS, give_back)
                try:
                    yield message
                finally:
                    slow.cancel()
        finally:
            give_back()

    async def send_incoming(self, incoming: IncomingPublish, chunk_bytes: int) -> AsyncIterator[bytes]:
        """A publish's bytes as chunk messages as they land (cut-through)."""
        sent = 0
        while sent < incoming.byte_size:
            try:
                landed = await incoming.landed_beyond(sent, INCOMING_STALL_SECONDS)
            except TimeoutError:
                raise PublishAborted(
                    f"the publish of {incoming.model!r} sent nothing for {INCOMING_STALL_SECONDS:g}s; "
                    "fetch the version once it is committed"
                ) from None
            for message in framing.chunk_messages(incoming.buffer[sent:landed], chunk_bytes):
                yield message
            sent = landed
