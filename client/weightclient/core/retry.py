"""One deadline (made once, handed down: a retry gets what is left) and one retry policy for every caller."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass

from weightserver.protocol.errors import ServerUnavailable

# Jitter from a generator of its own: a retry in a background thread never draws from (or
# reseeds the sequence of) the global `random` a training script seeds for reproducibility.
_JITTER = random.Random()


@dataclass(frozen=True)
class Deadline:
    """When a caller's time runs out: a `time.monotonic()` reading, or None for never."""

    at: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds)

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def within(self, seconds: float) -> float:
        left = self.remaining()
        return seconds if left is None else min(seconds, left)


NEVER = Deadline()


@dataclass(frozen=True)
class RetryPolicy:
    """Waits between attempts: `first` seconds, doubling up to `longest`, scaled by 1 +- jitter."""

    first: float = 0.05
    longest: float = 2.0
    jitter: float = 0.5
    retry_on: tuple[type[BaseException], ...] = (ServerUnavailable,)

    def delay(self, attempt: int) -> float:
        base = min(self.longest, self.first * 2 ** min(attempt, 62))
        return base * (1.0 + self.jitter * (2.0 * _JITTER.random() - 1.0))

    def _delay_within(self, attempt: int, deadline: Deadline) -> float | None:
        delay, left = self.delay(attempt), deadline.remaining()
        return None if left is not None and delay >= left else delay

    def wait(self, attempt: int, deadline: Deadline = NEVER, wake: threading.Event | None = None) -> bool:
        """Sleep before retry `attempt` (until `wake` is set, if sooner); False if the deadline would pass first."""
        delay = self._delay_within(attempt, deadline)
        if delay is not None:
            (wake or threading.Event()).wait(delay)
        return delay is not None

    async def wait_async(self, attempt: int, deadline: Deadline = NEVER, wake: asyncio.Event | None = None) -> bool:
        delay = self._delay_within(attempt, deadline)
        if delay is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for((wake or asyncio.Event()).wait(), delay)
        return delay is not None


DEFAULT_RETRY = RetryPolicy()
