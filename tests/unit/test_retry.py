"""The one retry policy and deadline type (weightclient.core.retry)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from weightclient.core.retry import NEVER, Deadline, RetryPolicy


def test_delays_double_up_to_the_longest_within_their_jitter():
    policy = RetryPolicy(first=0.1, longest=0.5, jitter=0.5)
    for attempt, base in enumerate([0.1, 0.2, 0.4, 0.5, 0.5]):
        assert all(0.5 * base <= policy.delay(attempt) <= 1.5 * base for _ in range(50))


def test_a_deadline_carries_what_is_left():
    deadline = Deadline.after(0.2)
    time.sleep(0.05)
    assert 0.1 < deadline.remaining() <= 0.15
    assert deadline.within(10.0) == pytest.approx(deadline.remaining(), abs=0.01)
    assert deadline.within(0.01) == 0.01
    assert NEVER.remaining() is None and NEVER.within(3.0) == 3.0 and not NEVER.expired()
    time.sleep(0.16)
    assert deadline.expired() and deadline.remaining() == 0.0


def test_a_wake_ends_an_async_wait():
    async def woken() -> float:
        wake = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, wake.set)
        started = time.monotonic()
        assert await RetryPolicy(first=5.0, longest=5.0, jitter=0.0).wait_async(0, NEVER, wake)
        return time.monotonic() - started

    assert asyncio.run(woken()) < 1.0


def test_a_wake_ends_a_wait():
    wake = threading.Event()
    threading.Timer(0.05, wake.set).start()
    started = time.monotonic()
    assert RetryPolicy(first=5.0, longest=5.0, jitter=0.0).wait(0, NEVER, wake=wake)
    assert time.monotonic() - started < 1.0


def test_jitter_leaves_the_global_random_sequence_alone():
    """A training script that seeds `random` gets the same sequence whatever retries ran meanwhile
    (a background resubscription, a relay's backoff)."""
    import random

    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    policy = RetryPolicy(first=0.1, longest=5.0, jitter=0.5)
    delays = [policy.delay(attempt) for attempt in range(20)]
    assert [random.random() for _ in range(3)] == expected
    assert len(set(delays)) > 1  # jittered all the same
