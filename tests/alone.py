"""A pytest plugin: a test marked `alone` runs while no other test runs, on any worker.

scripts/test.sh runs the suite on 2 workers (pytest-xdist). A test is marked alone when it changes
or measures what the whole host shares, or times itself:
- tests/integration/test_huge_pages.py sets the kernel's shared-memory huge page setting and
  counts huge pages host-wide;
- tests/integration/test_large_model.py needs most of the host's memory (beside another test,
  a 24 GiB machine ran out);
- tests/system/test_chaos.py fits every fault into a 20 s run.

Every test holds a shared lock for its whole run (setup, call and teardown, so its module's
fixtures too), and an alone test an exclusive one. Each first takes a turnstile, which an alone
test keeps while it waits, so the others' shared locks cannot keep it out for ever. The lock
files are per host (in $WEIGHTSERVER_TEST_LOCK_DIR, else the temporary folder), so two suites
running at once, from two checkouts, keep out of each other's alone tests too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from waiting import wait_until

WAIT = 1200.0  # s: longer than any one test's run (test_large_model.py allows 600 s)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: runs while no other test runs, on any worker: it changes or measures what the whole host "
        "shares (a kernel setting, a host-wide counter, most of its memory) or times itself (tests/alone.py)",
    )


def _flock(file: IO, operation: int, what: str) -> None:
    """flock(file, operation), polled so that a lock a stray process holds fails the run, not hangs it."""

    def taken() -> bool:
        try:
            fcntl.flock(file, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    wait_until(taken, timeout=WAIT, step=0.01, what=f"{what} (`fuser -v {file.name}` names its holder)")


@contextlib.contextmanager
def host_turn(exclusive: bool) -> Iterator[None]:
    """A shared (any test) or exclusive (an alone test) hold of the host's test lock."""
    folder = Path(os.environ.get("WEIGHTSERVER_TEST_LOCK_DIR") or tempfile.gettempdir())
    with (
        open(folder / "weightserver-tests.turnstile", "a") as turnstile,
        open(folder / "weightserver-tests.lock", "a") as lock,
    ):
        _flock(turnstile, fcntl.LOCK_EX, "the test turnstile")
        _flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, "the test lock")
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the files releases both


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with host_turn(exclusive=item.get_closest_marker("alone") is not None):
        yield
