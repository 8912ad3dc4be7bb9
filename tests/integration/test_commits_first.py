"""Publishes go before stream fetches while the server sets a publish's pace, and only then
(weightserver/publish/priority.py): from a header or `uploaded` while a budget lasts
(COMMIT_FIRST_SECONDS per publish, and a bucket per caller), not while chunks arrive at the
publisher's pace, and from the commit message until the publish ends. The turn is driven on a
real event loop here; tests/integration/test_fetch_turns.py shows a commit holding real stream fetches, the
tests below the unit tests a stalled and a slow publisher that must not, and
tests/integration/test_publisher_isolation.py publishers that stall, drip or reopen."""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

import weightserver.publish.priority as commits_first
from tests.integration.test_fetch_turns import MODEL, WAIT, safetensors_file
from weightclient.core.service_client import WeightServiceClient
from weightserver.publish.priority import CommitsFirst
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

EXPIRY = 0.2


@pytest.fixture(autouse=True)
def short_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commits_first, "COMMIT_FIRST_SECONDS", EXPIRY)


async def _waited(first: CommitsFirst) -> float:
    """How long a fetch's chunk waits now."""
    started = time.monotonic()
    await first.wait()
    return time.monotonic() - started


def test_a_header_holds_fetches_until_its_hold_expires() -> None:
    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish() as turn:
            turn.header()
            assert turn.held
            assert await _waited(first) >= EXPIRY * 0.9  # the header held this chunk
            await asyncio.sleep(0.05)  # the expiry has run: the publisher is not sending
            assert not turn.held and await _waited(first) < EXPIRY / 4

    asyncio.run(scenario())


def test_chunks_let_fetches_go_on_and_bytes_in_holds_until_the_publish_ends() -> None:
    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish() as turn:
            turn.header()
            turn.chunk()  # bytes arrive at the publisher's pace
            assert not turn.held and await _waited(first) < EXPIRY / 4
            turn.bytes_in()  # the commit message: the server's work from here
            await asyncio.sleep(EXPIRY * 1.5)  # no expiry once the bytes are in
            assert turn.held
            waiter = asyncio.ensure_future(_waited(first))
            await asyncio.sleep(EXPIRY / 4)
        assert not turn.held
        assert EXPIRY / 4 <= await waiter < EXPIRY * 0.9  # released by the publish's end, not a timeout
        assert await _waited(first) < EXPIRY / 4

    asyncio.run(scenario())


def test_fetches_wait_while_any_publish_holds_its_turn() -> None:
    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish() as a, first.publish() as b:
            a.bytes_in()
            b.header()
            b.uploaded()
            b.header()  # a second model's header in a group: already held
            b.release()
            assert a.held and not b.held
            assert await _waited(first) >= EXPIRY * 0.9
        assert await _waited(first) < EXPIRY / 4

    asyncio.run(scenario())


def test_a_publish_waits_on_its_publisher_for_one_budget_in_all() -> None:
    """Neither a second header nor `uploaded` renews the hold once the publish spent its budget."""

    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish("trainer") as turn:
            turn.header()
            await asyncio.sleep(EXPIRY / 2)
            turn.written()  # no renewal
            turn.uploaded()  # held already: the same budget goes on
            await asyncio.sleep(EXPIRY / 2 + 0.05)
            assert not turn.held  # spent
            turn.header()
            turn.uploaded()
            assert not turn.held and await _waited(first) < EXPIRY / 4
            turn.bytes_in()  # the commit message: the server's work, whatever the budget
            assert turn.held

    asyncio.run(scenario())


def test_a_chunk_ends_the_wait_and_keeps_what_is_left_of_the_budget() -> None:
    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish("trainer") as turn:
            turn.header()
            await asyncio.sleep(EXPIRY / 4)
            turn.chunk()
            assert not turn.held
            turn.uploaded()  # about 3/4 of the budget left
            assert turn.held
            await asyncio.sleep(EXPIRY * 0.75 + 0.05)
            assert not turn.held

    asyncio.run(scenario())


def test_a_callers_new_publishes_share_its_bucket_and_others_have_their_own() -> None:
    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish("dripper") as turn:
            turn.header()
            await asyncio.sleep(EXPIRY + 0.05)
            assert not turn.held
        with first.publish("dripper") as again, first.publish("dripper") as more:
            again.header()
            more.header()
            # The bucket refilled by CALLER_REFILL x the time since: a sliver, not a new budget.
            assert await _waited(first) < EXPIRY / 4
        with first.publish("trainer") as other:
            other.header()
            assert other.held and await _waited(first) >= EXPIRY * 0.9

    asyncio.run(scenario())


def test_concurrent_publishes_of_one_caller_cannot_overdraw_its_bucket() -> None:
    async def scenario() -> None:
        first = CommitsFirst()
        with first.publish("caller") as a, first.publish("caller") as b:
            a.header()
            b.header()  # the bucket went to a
            assert a.held and not b.held
            await asyncio.sleep(EXPIRY / 4)
            a.chunk()  # a gives back what it did not use
            b.header()
            assert b.held
            await asyncio.sleep(EXPIRY * 0.75 + 0.05)
            assert not b.held

    asyncio.run(scenario())


@pytest.fixture
def server_and_version(make_server) -> Iterator[tuple[str, bytes]]:
    """A server holding version 1 of MODEL: 7 chunks of 64 KiB over the stream."""
    server = make_server()
    data = safetensors_file(6 * 64 * 1024)
    with WeightServiceClient(server.address, chunk_bytes=64 * 1024) as client:
        client.publish_bytes(MODEL, data, transport="stream")
    yield server.address, data


def _timed_stream_fetch(address: str) -> tuple[float, bytes]:
    with WeightServiceClient(address, chunk_bytes=64 * 1024) as client:
        started = time.monotonic()
        fetched = client.fetch_bytes(MODEL, version=1, transport="stream", timeout=WAIT)
        return time.monotonic() - started, bytes(fetched.data)


def _publish_fed_by(address: str, messages: queue.Queue) -> tuple[grpc.Channel, grpc.Future]:
    """A raw Publish call whose request messages are whatever `messages` yields, until None."""
    channel = grpc.insecure_channel(address)
    call = pb_grpc.WeightServiceStub(channel).Publish.future(iter(messages.get, None), timeout=WAIT)
    return channel, call


def test_a_publisher_stalled_after_its_header_does_not_slow_fetches(server_and_version) -> None:
    address, data = server_and_version
    fresh = safetensors_file(64 * 1024)
    header = pb.PublishHeader(model=MODEL, total_bytes=len(fresh))
    messages: queue.Queue = queue.Queue()
    channel, call = _publish_fed_by(address, messages)
    try:
        messages.put(pb.PublishRequest(header=header))
        time.sleep(0.5)  # the header arrived, and its hold expired
        during, fetched = _timed_stream_fetch(address)
        messages.put(pb.PublishRequest(chunk=fresh))
        messages.put(pb.PublishRequest(commit=pb.PublishCommit(sha256=[hashlib.sha256(fresh).hexdigest()])))
        messages.put(None)
        assert call.result(WAIT).version.version == 2
    finally:
        channel.close()
    assert fetched == data
    assert during < 6 * EXPIRY  # held chunk by chunk, the 6 later chunks would take 1.2 s


def test_a_slow_chunked_publisher_does_not_slow_fetches(server_and_version) -> None:
    address, data = server_and_version
    fresh = safetensors_file(4 * 64 * 1024)
    header = pb.PublishHeader(model=MODEL, total_bytes=len(fresh))
    messages: queue.Queue = queue.Queue()
    channel, call = _publish_fed_by(address, messages)
    fetches: list[tuple[float, bytes]] = []
    try:
        messages.put(pb.PublishRequest(header=header))
        messages.put(pb.PublishRequest(chunk=fresh[:100]))  # the publisher's link is slow
        fetcher = threading.Thread(target=lambda: fetches.append(_timed_stream_fetch(address)))
        fetcher.start()
        for start in range(100, len(fresh), 64 * 1024):
            time.sleep(0.1)
            messages.put(pb.PublishRequest(chunk=fresh[start : start + 64 * 1024]))
        fetcher.join(WAIT)
        messages.put(pb.PublishRequest(commit=pb.PublishCommit(sha256=[hashlib.sha256(fresh).hexdigest()])))
        messages.put(None)
        assert call.result(WAIT).version.version == 2
    finally:
        channel.close()
    ((during, fetched),) = fetches
    assert fetched == data
    assert during < 6 * EXPIRY
