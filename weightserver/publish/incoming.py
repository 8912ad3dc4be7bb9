"""Incoming publishes: a publish's bytes while they arrive, for followers that take them early.

Cut-through: a watcher that asked for it hears of a publish as its first bytes land and fetches
them while the rest arrive; it applies them only once the commit event names the same bytes and
they match the committed xxh3, so a publish that fails half-way is never applied. One thread
writes an `IncomingPublish`'s bytes; fetches on other loops wait for more with `landed_beyond`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable

from weightserver.protocol.errors import PublishAborted, UploadNotFound, clipped_repr

REMEMBERED_COMMITS = 256  # commits remembered with the announcement they ended, for Watch events


class IncomingPublish:
    """One model's bytes on their way into a publish: `buffer[:landed]` are in place."""

    def __init__(self, model: str, buffer: memoryview, on_end: Callable[[IncomingPublish], None]) -> None:
        self.id = secrets.token_hex(16)
        self.model = model
        self.buffer = buffer
        self.byte_size = buffer.nbytes
        self.landed = 0
        self.failure: str | None = None  # why the publish failed; None while it may still commit
        self.ended = False
        self._on_end = on_end
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def advance(self, end: int) -> None:
        """Bytes [0, end) are in place (from the one thread that writes them)."""
        self.landed = end
        self._wake()

    def fail(self, why: str) -> None:
        """The publish failed or was abandoned: its bytes never become a version."""
        self._end(why)

    def _end(self, failure: str | None) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended, self.failure = True, failure
            if failure is None:
                self.landed = self.byte_size
        self._wake()
        self._on_end(self)

    async def landed_beyond(self, sent: int, timeout: float) -> int:
        """How many bytes are in place, once more than `sent` (or all). PublishAborted once the
        publish failed; TimeoutError after `timeout` with no new byte."""
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._lock:
                if self.failure is not None:
                    raise PublishAborted(
                        f"the publish of {self.model!r} failed before all its bytes arrived ({self.failure}); "
                        "nothing was committed"
                    )
                if self.landed > sent or self.landed == self.byte_size:
                    return self.landed
                self._waiters.append((loop, event))
            async with asyncio.timeout(timeout):
                await event.wait()

    def _wake(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its fetch is gone
                loop.call_soon_threadsafe(event.set)


class IncomingPublishes:
    """The publishes being received, by id; listeners hear of each one's start and end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, IncomingPublish] = {}
        self._commits: OrderedDict[tuple[str, int], str] = OrderedDict()  # (model, version) -> id
        self._listeners: list[Callable[[IncomingPublish], None]] = []

    def start(self, model: str, buffer: memoryview) -> IncomingPublish:
        """Register a publish whose bytes begin to arrive in `buffer`, and announce it."""
        incoming = IncomingPublish(model, buffer, self._ended)
        with self._lock:
            self._open[incoming.id] = incoming
        self._tell(incoming)
        return incoming

    def get(self, incoming_id: str, model: str) -> IncomingPublish:
        """The publish `incoming_id` of `model` while its bytes arrive; UploadNotFound once it ended."""
        with self._lock:
            incoming = self._open.get(incoming_id)
        if incoming is None or incoming.model != model:
            raise UploadNotFound(
                f"model {clipped_repr(model)}: publish {clipped_repr(incoming_id)} is not incoming any more (it "
                "committed, failed, or was never announced here); fetch the committed version instead"
            )
        return incoming

    def committed(self, incoming: IncomingPublish, model: str, version: int) -> None:
        """`incoming`'s bytes became `version`: remembered, so that its commit event names them."""
        with self._lock:
            self._commits[(model, version)] = incoming.id
            while len(self._commits) > REMEMBERED_COMMITS:
                self._commits.popitem(last=False)
        incoming._end(None)  # every byte is in place for good

    def id_of(self, model: str, version: int) -> str:
        """The announcement whose bytes became `version` of `model` ("" if none)."""
        with self._lock:
            return self._commits.get((model, version), "")

    def subscribe(self, listener: Callable[[IncomingPublish], None]) -> Callable[[], None]:
        """Call `listener(incoming)` as each publish starts and fails; returns the unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    def _ended(self, incoming: IncomingPublish) -> None:
        with self._lock:
            self._open.pop(incoming.id, None)
        if incoming.failure is not None:
            self._tell(incoming)  # a commit is told by its version's event

    def _tell(self, incoming: IncomingPublish) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(incoming)
