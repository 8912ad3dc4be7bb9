"""Publish priority: while a publish holds its turn, each stream fetch waits (at most COMMIT_FIRST_SECONDS) before its
next chunk, so the version every collector waits for does not queue behind their chunks on the loop. A publish holds
from its commit message to its end, and after a header or `uploaded` while budgets last (per publish, and per caller
refilling at CALLER_REFILL s/s, so a stalling or reopening publisher gains nothing); never while chunks arrive."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

COMMIT_FIRST_SECONDS = 0.25  # a fetch's longest wait per chunk; each publish's and caller's waiting hold
CALLER_REFILL = 0.1  # seconds of waiting hold per second refilled into a caller's bucket
MIN_HOLD_SECONDS = 0.005  # a shorter waiting hold is not started
MAX_CALLERS = 1024  # buckets kept; beyond this, full ones of callers holding nothing are forgotten


@dataclass
class _Bucket:
    """One caller's waiting hold left, as of `at` (the loop's clock)."""

    level: float
    at: float
    holding: int = 0  # waiting holds drawing on it now

    def refilled(self, now: float) -> float:
        self.level = min(COMMIT_FIRST_SECONDS, self.level + (now - self.at) * CALLER_REFILL)
        self.at = now
        return self.level


class CommitsFirst:
    """The publishes holding their turn, and the wait fetches make for them (loop only)."""

    def __init__(self) -> None:
        self._holding = 0  # publishes holding their turn now
        self._none = asyncio.Event()  # set while none is
        self._none.set()
        self._buckets: dict[str, _Bucket] = {}

    def publish(self, caller: str = "") -> contextlib.closing[PublishTurn]:
        """A publish's turn, released as its `with` ends."""
        return contextlib.closing(PublishTurn(self, caller))

    async def wait(self) -> None:
        if not self._none.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none.wait(), COMMIT_FIRST_SECONDS)

    def _bucket(self, caller: str, now: float) -> _Bucket:
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= MAX_CALLERS:
                self._buckets = {
                    name: b for name, b in self._buckets.items() if b.holding or b.refilled(now) < COMMIT_FIRST_SECONDS
                }
            bucket = self._buckets[caller] = _Bucket(COMMIT_FIRST_SECONDS, now)
        bucket.refilled(now)
        return bucket


class PublishTurn:
    """One publish's turn, told of its messages as they arrive."""

    def __init__(self, owner: CommitsFirst, caller: str = "") -> None:
        self._owner, self._caller = owner, caller
        self.held = self._committing = False  # committing: the commit message came
        self._spent = 0.0  # waiting hold taken so far (all of the one now, until it ends)
        self._expiry: asyncio.TimerHandle | None = None  # the end of the waiting hold now

    def written(self) -> None:
        """A shared-memory writer's progress (a memory copy's pace): a hold goes on, not renewed."""

    def chunk(self) -> None:
        """Chunks arrive at the publisher's pace: fetches go on."""
        if not self._committing:
            self._hold(False)

    def bytes_in(self) -> None:
        """The commit message: hold until `release()`."""
        self._committing = True
        self._hold(True)

    def release(self) -> None:
        self._committing = False
        self._hold(False)

    close = release  # (contextlib.closing)

    def header(self) -> None:
        """A header or `uploaded`: hold for as long as the budgets allow, from now."""
        if self.held:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        bucket = self._owner._bucket(self._caller, now)
        grant = min(COMMIT_FIRST_SECONDS - self._spent, bucket.level)
        if grant < MIN_HOLD_SECONDS:
            return
        bucket.level -= grant  # taken now, so that the caller's other publishes cannot too
        bucket.holding += 1
        self._spent += grant
        self._hold(True)
        self._expiry = loop.call_at(now + grant, self.chunk)  # its end: as a chunk, fetches go on

    uploaded = header

    def _hold(self, held: bool) -> None:
        """End the waiting hold, if one runs (what it took and did not use goes back), then hold or not."""
        if self._expiry is not None:
            self._expiry.cancel()
            now = asyncio.get_running_loop().time()
            left = max(self._expiry.when() - now, 0.0)
            self._spent -= left
            bucket = self._owner._bucket(self._caller, now)
            bucket.level = min(COMMIT_FIRST_SECONDS, bucket.level + left)
            bucket.holding -= 1
            self._expiry = None
        if held != self.held:
            self.held, owner = held, self._owner
            owner._holding += 1 if held else -1
            if owner._holding:
                owner._none.clear()
            else:
                owner._none.set()
