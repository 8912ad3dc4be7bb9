"""What the demo processes print: one prefixed line at a time, progress at most every few
seconds, and none of torchrl's chatter."""

from __future__ import annotations

import logging
import time
import warnings

NAME_WIDTH = 12


def say(who: str, message: str) -> None:
    """Print one line, prefixed with the process name (lines of all processes interleave)."""
    print(f"{who:<{NAME_WIDTH}} {message}", flush=True)


class Every:
    """True at most once per `seconds` (for progress lines)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._next = time.monotonic() + seconds

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.seconds
        return True


def quiet_torchrl() -> None:
    """torchrl's info logs and its deprecation notice for the WeightUpdaterBase path (which the
    collector uses on purpose) stay out of the progress output."""
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*WeightUpdaterBase.*", category=DeprecationWarning)
