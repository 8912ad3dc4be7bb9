"""TransportChain: which transports a transfer tries, in what order, and one retry rule.

"auto" tries shared memory, bulk TCP, then the stream; a named one is tried alone before the
stream. The rule: a fast transport that failed is left out of "auto" for `retry_seconds`; one
that carried a payload is trusted again at once. The stream, which every server offers, is
always last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from weightclient.transports.base import Transport
from weightserver.protocol.errors import InvalidRequest

log = logging.getLogger(__name__)

RETRY_SECONDS = 60.0


class TransportChain:
    """The client's transports: fast ones in order of preference, then the stream."""

    def __init__(self, fast: Sequence[Transport], stream: Transport, *, retry_seconds: float = RETRY_SECONDS) -> None:
        self.fast = list(fast)
        self.stream = stream
        self.retry_seconds = retry_seconds
        self.by_name: dict[str, Transport] = {t.name: t for t in (*self.fast, stream)}
        self.by_kind: dict[int, Transport] = {t.kind: t for t in (*self.fast, stream)}
        self._failed_at: dict[str, float] = {}
        self._worked: set[str] = set()

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *self.by_name)

    def order(self, choice: str) -> list[Transport]:
        """The fast transports to try for `choice`, best first (the stream comes after them)."""
        if choice == "auto":
            return [t for t in self.fast if not self.resting(t)]
        if choice not in self.by_name:
            raise InvalidRequest(f"transport must be one of {', '.join(self.choices)}, got {choice!r}")
        return [] if choice == self.stream.name else [self.by_name[choice]]

    def resting(self, transport: Transport) -> bool:
        failed = self._failed_at.get(transport.name)
        return failed is not None and time.monotonic() - failed < self.retry_seconds

    def failed(self, transport: Transport, reason: object) -> None:
        if not self.resting(transport):
            log.warning(
                "%s transport failed (%s); using the next one for %.0fs", transport.name, reason, self.retry_seconds
            )
        self._failed_at[transport.name] = time.monotonic()
        self._worked.discard(transport.name)

    def worked(self, transport: Transport) -> None:
        self._failed_at.pop(transport.name, None)
        self._worked.add(transport.name)

    def usable(self, name: str) -> bool | None:
        """What this client learned of a transport: True once it carried a payload, False while
        it rests after a failure, None before either."""
        transport = self.by_name[name]
        if self.resting(transport):
            return False
        return True if name in self._worked else None
