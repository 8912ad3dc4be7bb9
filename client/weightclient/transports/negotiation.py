"""TransportChain: the transports a transfer tries, in order ("auto": shared memory, bulk, then
the stream, always last; a named one alone before the stream). A fast one that failed rests out
of "auto" for `rest_seconds`; one that carried a payload is trusted again at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from weightclient.transports.base import Transport
from weightserver.protocol.errors import InvalidRequest

log = logging.getLogger(__name__)

REST_SECONDS = 60.0


class TransportChain:
    """The client's transports: fast ones in order of preference, then the stream."""

    def __init__(self, fast: Sequence[Transport], stream: Transport, *, rest_seconds: float = REST_SECONDS) -> None:
        self.fast = list(fast)
        self.stream = stream
        self.rest_seconds = rest_seconds
        self.by_name: dict[str, Transport] = {t.name: t for t in (*self.fast, stream)}
        self.by_kind: dict[int, Transport] = {t.kind: t for t in (*self.fast, stream)}
        self._failed_at: dict[str, float] = {}
        self._worked: set[str] = set()

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *self.by_name)

    def order(self, choice: str) -> list[Transport]:
        if choice == "auto":
            return [*(t for t in self.fast if not self.resting(t)), self.stream]
        if choice not in self.by_name:
            raise InvalidRequest(f"transport must be one of {', '.join(self.choices)}, got {choice!r}")
        return [self.stream] if choice == self.stream.name else [self.by_name[choice], self.stream]

    def resting(self, transport: Transport) -> bool:
        failed = self._failed_at.get(transport.name)
        return failed is not None and time.monotonic() - failed < self.rest_seconds

    def failed(self, transport: Transport, reason: object) -> None:
        if not self.resting(transport):
            log.warning(
                "%s transport failed (%s); using the next one for %.0fs", transport.name, reason, self.rest_seconds
            )
        self._failed_at[transport.name] = time.monotonic()
        self._worked.discard(transport.name)

    def worked(self, transport: Transport) -> None:
        self._failed_at.pop(transport.name, None)
        self._worked.add(transport.name)

    def usable(self, name: str) -> bool | None:
        """True once a transport carried a payload, False while it rests after a failure, None before."""
        if self.resting(self.by_name[name]):
            return False
        return True if name in self._worked else None
