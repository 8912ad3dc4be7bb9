"""SpareUploads: the next publish's upload, set up while the trainer trains.

Setting an upload up costs the server (and a shared-memory writer) a page-table fill of the
model's size, about 0.3 ms per MiB; a trainer publishes the same size again and again, so the
next upload is set up in the background after each. Models over MAX_SPARE_BYTES get none: a
second copy in the server's memory (a 4 GiB model's ran a 24 GiB machine out) costs more.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from weightclient.transports.base import Transport
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

SPARE_SECONDS = 45.0  # under the server's 60 s for an upload nobody named
MAX_SPARE_BYTES = 1 << 30


@dataclass(frozen=True)
class Spare:
    transport: Transport
    answer: pb.NegotiateResponse
    expires: float


class SpareUploads:
    """At most one spare per model and transport; `negotiate` sets an upload up (Negotiate)."""

    def __init__(self, negotiate: Callable[[pb.NegotiateRequest], pb.NegotiateResponse]) -> None:
        self._negotiate = negotiate
        self._lock = threading.Lock()
        self._spares: dict[tuple[str, int], Spare] = {}
        self._closed = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightclient-spare-uploads")

    def take(self, model: str, size: int, order: Sequence[Transport]) -> Spare | None:
        """A fresh spare of `model` at `size` on the first transport of `order` that has one."""
        now = time.monotonic()
        stale: list[Spare] = []
        found = None
        with self._lock:
            for transport in order:
                spare = self._spares.pop((model, transport.kind), None)
                if spare is None:
                    continue
                if spare.expires > now and spare.answer.payload.byte_size == size:
                    found = spare
                    break
                stale.append(spare)
        for spare in stale:
            spare.transport.release(spare.answer.payload)
        return found

    def refill(self, model: str, size: int, transport: Transport) -> None:
        """Set up the next upload of `model` at `size` on `transport`, in the background."""
        if size > MAX_SPARE_BYTES:
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._thread.submit(self._prepare, model, size, transport)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares, self._spares = list(self._spares.values()), {}
        self._thread.shutdown(wait=False, cancel_futures=True)
        for spare in spares:
            spare.transport.release(spare.answer.payload)

    def _prepare(self, model: str, size: int, transport: Transport) -> None:
        header = pb.PublishHeader(model=model, total_bytes=size)
        request = pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH, accept=[transport.kind], publish=header)
        try:
            answer = self._negotiate(request)
            if answer.transport != transport.kind:
                return
            transport.prepare(answer.payload)
        except Exception as exc:  # a spare is a bonus: the next publish negotiates as usual
            log.debug("no spare upload of %r over %s: %s", model, transport.name, exc)
            return
        spare = Spare(transport, answer, time.monotonic() + SPARE_SECONDS)
        with self._lock:
            unused = [self._spares.pop((model, transport.kind), None)]
            if self._closed:
                unused.append(spare)
            else:
                self._spares[(model, transport.kind)] = spare
        for other in unused:
            if other is not None:
                other.transport.release(other.answer.payload)
