"""The one retry policy and deadline type (weightclient.core.retry)."""

from __future__ import annotations

import asyncio
import time

import pytest

from weightclient.core.retry import NEVER, Deadline, RetryPolicy
from weightserver.protocol.errors import InvalidRequest, ServerUnavailable

FAST = RetryPolicy(first=0.01, longest=0.02, jitter=0.0)


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


def test_a_call_is_retried_until_it_answers_each_time_with_the_same_deadline():
    seen = []

    def call(deadline: Deadline) -> str:
        seen.append(deadline)
        if len(seen) < 3:
            raise ServerUnavailable("down")
        return "ok"

    deadline = Deadline.after(5.0)
    assert FAST.call(call, deadline, "test") == "ok"
    assert seen == [deadline] * 3


def test_retrying_stops_before_the_deadline_would_pass():
    calls = []

    def call(deadline: Deadline):
        calls.append(time.monotonic())
        raise ServerUnavailable("down")

    started = time.monotonic()
    with pytest.raises(ServerUnavailable):
        RetryPolicy(first=0.05, longest=0.05, jitter=0.0).call(call, Deadline.after(0.12), "test")
    assert time.monotonic() - started < 0.12 and len(calls) == 3


def test_what_is_not_retryable_is_raised_at_once():
    calls = []

    def call(deadline: Deadline):
        calls.append(1)
        raise InvalidRequest("no")

    with pytest.raises(InvalidRequest):
        FAST.call(call, NEVER, "test")
    assert calls == [1]


def test_a_wake_ends_an_async_wait():
    async def woken() -> float:
        wake = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, wake.set)
        started = time.monotonic()
        assert await RetryPolicy(first=5.0, longest=5.0, jitter=0.0).wait_async(0, NEVER, wake)
        return time.monotonic() - started

    assert asyncio.run(woken()) < 1.0
