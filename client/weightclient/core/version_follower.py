"""VersionFollower: the newest version, from a Watch stream in a daemon thread (an updater asks the server only once
a newer one exists); with a `CutThrough`, versions received as published, kept if the commit's size and xxh3 match."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import xxhash

from weightclient.core.service_client import FetchedBytes, WatchStream, WeightServiceClient
from weightclient.transports.base import receive_buffer
from weightserver.protocol.errors import Cancelled, DeadlineExceeded, WeightServerError
from weightserver.protocol.version_info import IncomingEvent, VersionEvent

log = logging.getLogger(__name__)

RENEW_SECONDS = 30.0  # each Watch call ends after this and is renewed (stop() cancels the one under way)
RETRY_SECONDS = 1.0  # after a stream failed for good (the client's retry window ran out)
MAX_RECEIVING = 2  # publishes received at once; an announcement beyond waits its turn
HASH_STRETCH = 1 << 20  # received bytes are hashed once this many more are in


class CutThrough:
    """Early receives for one model's follower (its Watch thread calls `incoming`, `committed`)."""

    def __init__(self, client: WeightServiceClient, *, transport: str = "auto", timeout: float = 30.0) -> None:
        self._client, self._transport, self._timeout = client, transport, timeout
        self._receiving: dict[str, Future[tuple[FetchedBytes, str]]] = {}
        self._threads = ThreadPoolExecutor(MAX_RECEIVING, thread_name_prefix="weightclient-cut-through")
        self._lock = threading.Lock()
        self._spare: memoryview | None = None  # a receive buffer handed back after its update was applied
        self.landed = 0.0  # time.monotonic() when a receive's bytes last landed
        self._closed = False

    def incoming(self, announced: IncomingEvent) -> None:
        if self._closed:
            return
        if announced.failed:
            if (future := self._receiving.pop(announced.id, None)) is not None:
                future.cancel()  # still queued; a running receive ends on its own, cut short
            return
        if announced.id not in self._receiving:
            self._receiving[announced.id] = self._threads.submit(self._receive, announced)
        # Receives whose commit never came (a server that restarted meanwhile) are let go.
        for stale in [i for i, f in self._receiving.items() if f.done()][: -MAX_RECEIVING or None]:
            self._receiving.pop(stale)

    def busy(self) -> bool:
        return any(not future.done() for future in list(self._receiving.values()))

    def landing(self) -> bool:
        """Whether bytes landed within the timeout: a receive under way, at its publisher's pace."""
        return time.monotonic() - self.landed < self._timeout

    def expects(self, event: VersionEvent) -> bool:
        return bool(event.incoming) and event.incoming in self._receiving

    def committed(self, event: VersionEvent) -> FetchedBytes | None:
        """The version `event` announces, from the bytes received early if they match."""
        future = self._receiving.pop(event.incoming, None) if event.incoming else None
        if future is None:
            return None
        try:
            early, digest = self._result(future)
        except Exception as exc:  # cut short, a failed publish, a timeout: fetch it normally
            log.info("receiving %s v%d early failed (%s); fetching it", event.info.model, event.version, exc)
            return None
        info, data = event.info, early.data
        if data.nbytes != info.byte_size or digest != info.xxh3:
            log.warning("bytes received early for %s v%d do not match it; fetching it", info.model, info.version)
            self.give_back(data)
            return None
        return replace(early, info=info)

    def _result(self, future: Future[tuple[FetchedBytes, str]]) -> tuple[FetchedBytes, str]:
        """The receive's result, waited for as long as its bytes keep landing (it ends on a stall)."""
        while True:
            try:
                return future.result(timeout=self._timeout)
            except TimeoutError:
                if not self.landing():
                    raise

    def give_back(self, buffer: memoryview | None) -> None:
        if buffer is not None and not buffer.readonly:
            with self._lock:
                if self._spare is None or buffer.nbytes > self._spare.nbytes:
                    self._spare = buffer

    def close(self) -> None:
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _receive(self, announced: IncomingEvent) -> tuple[FetchedBytes, str]:
        """The bytes and their xxh3, hashed a stretch at a time as they land."""
        with self._lock:
            spare, self._spare = self._spare, None
        into = receive_buffer(announced.byte_size, spare, huge=True)  # kept: the spare of the next receive
        hasher, hashed = xxhash.xxh3_128(), 0

        def follow(received: int, total: int) -> None:
            nonlocal hashed
            self.landed = time.monotonic()
            if received - hashed >= HASH_STRETCH or received == total:
                hasher.update(into[hashed:received])
                hashed = received

        try:
            early = self._client.fetch_incoming(
                announced, transport=self._transport, timeout=self._timeout, into=into, progress=follow
            )
        except WeightServerError:
            self.give_back(spare)
            raise
        if hashed != early.data.nbytes:
            hasher.reset()
            hasher.update(early.data)
        return early, hasher.hexdigest()


class VersionFollower:
    """`newest()`: None while no stream is open; a stalled one stays open until its renewal, so
    trust it only while `heard()` (its last event, or now while receiving) is recent."""

    def __init__(
        self, client: WeightServiceClient, model: str, since: int, cut_through: CutThrough | None = None
    ) -> None:
        self._client, self._model, self._cursor = client, model, since
        self._cut_through = cut_through
        self._ready: FetchedBytes | None = None  # the newest version received early, not yet taken
        self._settling: threading.Event | None = None  # set once an announced version's early bytes are checked
        self._open = False  # the current stream has delivered an event
        self._heard = 0.0  # time.monotonic() of the stream's last event
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watch: WatchStream | None = None  # the Watch under way: stop() cancels it
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=f"weightclient-follow-{model}", daemon=True)
        self._thread.start()

    def newest(self) -> int | None:
        if os.getpid() != self._pid:
            return None  # a forked child: the thread that kept this current is not here
        with self._lock:
            return self._cursor if self._open else None

    def take_ready(self, newer_than: int, timeout: float) -> FetchedBytes | None:
        """The newest version received early and verified, if newer than `newer_than` (once; `give_back` its buffer)."""
        if os.getpid() != self._pid:
            return None
        settling = self._settling  # (one reference read: no lock needed)
        while settling is not None and not settling.wait(timeout) and self._cut_through and self._cut_through.landing():
            pass  # its early receive is still under way
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None and ready.info.version <= newer_than:
            self.give_back(ready.data)
            return None
        return ready

    def give_back(self, buffer: memoryview | None) -> None:
        if self._cut_through is not None:
            self._cut_through.give_back(buffer)

    def heard(self) -> float:
        if self._cut_through is None:
            return self._heard
        if self._cut_through.busy():
            return time.monotonic()
        return max(self._heard, self._cut_through.landed)  # a publish's last bytes: its commit event comes next

    def running(self) -> bool:
        return os.getpid() == self._pid and self._thread.is_alive() and not self._stopped.is_set()

    def stop(self) -> None:
        """End the Watch thread now: its call is cancelled, the server's stream with it."""
        self._stopped.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.cancel()
        if self._cut_through is not None:
            self._cut_through.close()

    def _settle(self, ready: FetchedBytes | None, settling: threading.Event) -> None:
        replaced = None
        with self._lock:
            if ready is not None:
                replaced, self._ready = self._ready, ready
            if self._settling is settling:
                self._settling = None
        settling.set()
        if replaced is not None:
            self.give_back(replaced.data)

    def _run(self) -> None:
        while not self._stopped.is_set():
            cut_through = self._cut_through
            # From just before the cursor: the server replays its version, marking the stream open.
            watch = self._client.watch(
                self._model, since=max(0, self._cursor - 1), timeout=RENEW_SECONDS, incoming=cut_through is not None
            )
            with self._lock:
                self._watch = watch
            if self._stopped.is_set():  # stop() came before it was there to cancel
                watch.cancel()
            try:
                for event in watch:
                    self._heard = time.monotonic()
                    if isinstance(event, IncomingEvent):
                        cut_through.incoming(event)  # type: ignore[union-attr]
                        continue
                    settling = threading.Event() if cut_through is not None and cut_through.expects(event) else None
                    with self._lock:
                        self._settling = settling
                        self._cursor = max(self._cursor, event.version)
                        self._open = True
                    if settling is not None:
                        ready = None
                        try:
                            ready = cut_through.committed(event)  # type: ignore[union-attr]
                        finally:
                            self._settle(ready, settling)
                    if self._stopped.is_set():
                        return
            except DeadlineExceeded:
                pass  # the call's renewal: follow on from the cursor
            except (Cancelled, ValueError):
                return  # the client was closed
            except Exception as exc:
                log.info("following %r stopped (%s); asking the server before each update meanwhile", self._model, exc)
                self._stopped.wait(RETRY_SECONDS)
            else:
                self._stopped.wait(RETRY_SECONDS)  # the server ended the stream (it is stopping)
            finally:
                with self._lock:
                    self._open = False
