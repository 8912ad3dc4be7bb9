"""Incoming publishes (cut-through): a watcher fetches a publish's bytes while they arrive and
applies them once the commit event names them and the xxh3 matches, so a failed one never is."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable

from weightserver.protocol.errors import PublishAborted, UploadNotFound, clipped_repr
from weightserver.storage.store import subscribed

REMEMBERED_COMMITS = 256  # commits remembered with the announcement they ended, for Watch events


class IncomingPublish:
    """One model's bytes on their way into a publish: `buffer[:landed]` are in place."""

    def __init__(self, model: str, buffer: memoryview, on_end: Callable[[IncomingPublish], None]) -> None:
        self.id = secrets.token_hex(16)
        self.model, self.buffer = model, buffer
        self.byte_size = buffer.nbytes
        self.landed = 0
        self.failure: str | None = None  # why the publish failed; None while it may still commit
        self.ended = False
        self._on_end = on_end
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def advance(self, end: int) -> None:
        self.landed = end
        self._wake()

    def fail(self, why: str) -> None:
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
        """How many bytes are in place, once more than `sent` (or all); PublishAborted or TimeoutError."""
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
        incoming = IncomingPublish(model, buffer, self._ended)
        with self._lock:
            self._open[incoming.id] = incoming
        self._tell(incoming)
        return incoming

    def get(self, incoming_id: str, model: str) -> IncomingPublish:
        with self._lock:
            incoming = self._open.get(incoming_id)
        if incoming is None or incoming.model != model:
            raise UploadNotFound(
                f"model {clipped_repr(model)}: publish {clipped_repr(incoming_id)} is not incoming any more (it "
                "committed, failed, or was never announced here); fetch the committed version instead"
            )
        return incoming

    def committed(self, incoming: IncomingPublish, model: str, version: int) -> None:
        """Remembered, so that `version`'s commit event names `incoming`."""
        with self._lock:
            self._commits[(model, version)] = incoming.id
            while len(self._commits) > REMEMBERED_COMMITS:
                self._commits.popitem(last=False)
        incoming._end(None)  # every byte is in place for good

    def id_of(self, model: str, version: int) -> str:
        with self._lock:
            return self._commits.get((model, version), "")

    def subscribe(self, listener: Callable[[IncomingPublish], None]) -> Callable[[], None]:
        """Call `listener(incoming)` as each publish starts and fails; returns an unsubscribe."""
        return subscribed(self._lock, self._listeners, listener)

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
