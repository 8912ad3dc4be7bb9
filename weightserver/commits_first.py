"""Publishes go before stream fetches ("commits first").

A trainer must be able to publish while many collectors fetch: on a busy server the event loop
that serves 200 stream fetches also reads the publish's messages and hands its verification
and commit to threads, and each of those steps waits its turn behind the fetches' chunks.
While a publish holds its turn, every stream fetch holds its next chunk, each at most
COMMIT_FIRST_SECONDS: the CPU goes to the version every collector waits for, and a commit that
hangs (a disk that does not answer) slows fetches down but never stops them.

A publish holds its turn while the server, not the publisher, sets its pace:
- from its header, for at most COMMIT_FIRST_SECONDS: the bytes of a publish over a fast
  transport are already in, and its remaining messages follow at once, or a same-host writer
  is copying them into shared memory and says how far it has got (`written`: the hold goes on);
- not while its bytes arrive as chunks: their pace is the publisher's link, and a slow
  publisher must not slow every fetch down;
- from the moment its bytes are all in (an `uploaded` message, or the commit message) until it
  has committed or failed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

# The longest a stream fetch holds one chunk for a publish; also how long a publish's header
# holds fetches before its bytes are all in.
COMMIT_FIRST_SECONDS = 0.25


class CommitsFirst:
    """The publishes holding their turn now, and the wait stream fetches make for them. Used on
    the event loop's thread only."""

    def __init__(self) -> None:
        self._holding = 0  # publishes holding their turn now
        self._none = asyncio.Event()  # set while none is
        self._none.set()

    @contextlib.contextmanager
    def publish(self) -> Iterator[PublishTurn]:
        """One Publish call's turn; released when the block ends, whatever happened."""
        turn = PublishTurn(self)
        try:
            yield turn
        finally:
            turn.release()

    async def wait(self) -> None:
        """Return once no publish holds its turn, or after COMMIT_FIRST_SECONDS."""
        if not self._none.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none.wait(), COMMIT_FIRST_SECONDS)

    def _count(self, change: int) -> None:
        self._holding += change
        if self._holding:
            self._none.clear()
        else:
            self._none.set()


class PublishTurn:
    """One publish's turn: `header()`, `chunk()` and `bytes_in()` as its messages arrive."""

    def __init__(self, owner: CommitsFirst) -> None:
        self._owner = owner
        self._held = False
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def held(self) -> bool:
        return self._held

    def header(self) -> None:
        """A model's header arrived: hold, for at most COMMIT_FIRST_SECONDS unless its bytes
        are all in by then."""
        if self._held:
            return
        self._hold()
        self._expiry = asyncio.get_running_loop().call_later(COMMIT_FIRST_SECONDS, self.release)

    def chunk(self) -> None:
        """Bytes arrive as chunks: the publisher sets the pace, fetches go on."""
        self.release()

    def bytes_in(self) -> None:
        """A model's bytes are in (`uploaded`), or all of them (the commit message): hold until
        `release()` or the next chunk."""
        self._cancel_expiry()
        if not self._held:
            self._hold()

    def release(self) -> None:
        """Fetches go on (the publish ended, or its header's hold expired)."""
        self._cancel_expiry()
        if self._held:
            self._held = False
            self._owner._count(-1)

    def _hold(self) -> None:
        self._held = True
        self._owner._count(+1)

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
