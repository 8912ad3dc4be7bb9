"""Waiting in tests for something another thread or process does.

Wait for the thing an assertion is about, not for something that usually happens at the same
time: `wait_for(lambda: sample(relay, "..._bytes_total"), lambda n: n == size)` rather than
waiting for the version and then sampling the counter once. On time-out the AssertionError
names what was awaited and the last value seen, so a failure on a busy machine says how far it
got.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Generous: on a loaded 2-core CI machine a server process can take seconds to get a turn. A
# wait that is met returns at once, so a long limit costs nothing when things work.
WAIT_SECONDS = 30.0


def wait_for(
    read: Callable[[], T],
    until: Callable[[T], bool] = bool,
    *,
    timeout: float = WAIT_SECONDS,
    step: float = 0.05,
    what: str = "",
) -> T:
    """Call `read()` every `step` seconds until `until(value)` holds, and return that value.

    Raises AssertionError after `timeout` seconds, naming `what` (or `read`) and the last value
    read. An exception from `read` is not caught: a wait must not hide an error."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if until(value):
            return value
        if time.monotonic() > deadline:
            name = what or getattr(read, "__qualname__", repr(read))
            raise AssertionError(f"waited {timeout:g}s for {name}; the last value seen was {value!r}")
        time.sleep(step)


def wait_equal(read: Callable[[], T], expected: T, *, timeout: float = WAIT_SECONDS, what: str = "") -> T:
    """Wait until `read()` returns `expected` (see `wait_for`)."""
    return wait_for(read, lambda value: value == expected, timeout=timeout, what=what or f"== {expected!r}")


def wait_until(
    condition: Callable[[], object], timeout: float = WAIT_SECONDS, step: float = 0.05, what: str = ""
) -> None:
    """Wait until `condition()` is true (see `wait_for`; the value reported is the condition's)."""
    wait_for(condition, timeout=timeout, step=step, what=what)


def sigstop(pid: int, timeout: float = WAIT_SECONDS) -> None:
    """SIGSTOP process `pid` and wait until every one of its threads is stopped. kill()
    returns once the signal is sent; each thread stops when it next runs, which on a busy
    machine may be after a call the test meant the stopped process not to answer."""

    def states() -> set[str]:
        found = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that just ended
                found.add((task / "stat").read_text().rpartition(")")[2].split()[0])
        return found

    os.kill(pid, signal.SIGSTOP)
    wait_for(states, lambda found: found <= {"T", "t"}, timeout=timeout, what=f"every thread of {pid} stopped")
