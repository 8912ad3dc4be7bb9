"""CutThrough: receive a publish's bytes while they still arrive at the server, kept only if the
commit event names them and they match its size and xxh3 (else the version is fetched)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import xxhash

from weightclient.core.service_client import FetchedBytes, WeightServiceClient
from weightclient.transports.base import receive_buffer
from weightserver.protocol.errors import WeightServerError
from weightserver.protocol.version_info import Arriving, VersionEvent

log = logging.getLogger(__name__)

MAX_RECEIVING = 2  # publishes received at once; an announcement beyond waits its turn
HASH_STRETCH = 1 << 20  # received bytes are hashed once this many more are in


class CutThrough:
    """Early receives for one model's follower (its Watch thread calls `arriving`, `committed`)."""

    def __init__(self, client: WeightServiceClient, *, transport: str = "auto", timeout: float = 30.0) -> None:
        self._client = client
        self._transport = transport
        self._timeout = timeout
        self._receiving: dict[str, Future[tuple[FetchedBytes, str]]] = {}
        self._threads = ThreadPoolExecutor(MAX_RECEIVING, thread_name_prefix="weightclient-cut-through")
        self._lock = threading.Lock()
        self._spare: memoryview | None = None  # a receive buffer handed back after its update was applied
        self._closed = False

    def arriving(self, announced: Arriving) -> None:
        if self._closed:
            return
        if announced.failed:
            future = self._receiving.pop(announced.id, None)
            if future is not None:
                future.cancel()  # still queued; a running receive ends on its own, cut short
            return
        if announced.id not in self._receiving:
            self._receiving[announced.id] = self._threads.submit(self._receive, announced)
        # Receives whose commit never came (a server that restarted meanwhile) are let go.
        for stale in [i for i, f in self._receiving.items() if f.done()][: -MAX_RECEIVING or None]:
            self._receiving.pop(stale)

    def busy(self) -> bool:
        return any(not future.done() for future in list(self._receiving.values()))

    def expects(self, event: VersionEvent) -> bool:
        return bool(event.arriving) and event.arriving in self._receiving

    def committed(self, event: VersionEvent) -> FetchedBytes | None:
        """The version `event` announces, from the bytes received early if they match."""
        future = self._receiving.pop(event.arriving, None) if event.arriving else None
        if future is None:
            return None
        try:
            early, digest = future.result(timeout=self._timeout)
        except Exception as exc:  # cut short, a failed publish, a timeout: fetch it normally
            log.info("receiving %s v%d early failed (%s); fetching it", event.info.model, event.version, exc)
            return None
        info, data = event.info, early.data
        if data.nbytes != info.byte_size or digest != info.xxh3:
            log.warning("bytes received early for %s v%d do not match it; fetching it", info.model, info.version)
            self.give_back(data)
            return None
        return replace(early, info=info)

    def give_back(self, buffer: memoryview | None) -> None:
        if buffer is not None and not buffer.readonly:
            with self._lock:
                if self._spare is None or buffer.nbytes > self._spare.nbytes:
                    self._spare = buffer

    def close(self) -> None:
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _receive(self, announced: Arriving) -> tuple[FetchedBytes, str]:
        """The bytes and their xxh3, hashed a stretch at a time as they land."""
        with self._lock:
            spare, self._spare = self._spare, None
        into = receive_buffer(announced.byte_size, spare)
        hasher, hashed = xxhash.xxh3_128(), 0

        def follow(received: int, total: int) -> None:
            nonlocal hashed
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
