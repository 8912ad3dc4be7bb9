"""Watch against a real server: waiting for a first version, no missed versions under rapid
publishes, backlog then live events, gaps, several watchers, and cancellation.

Watchers run in threads that hand events over through queues; every wait has a timeout and
every watch a deadline, so a bug fails the test instead of hanging the suite.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from weightclient import VersionEvent, WeightClient
from weightserver import WeightServer

MODEL = "policy"
WAIT = 10.0  # seconds any single event may take
WATCH_DEADLINE = 60.0


class Subscriptions:
    """Counts the server's live watch subscriptions (by instrumenting VersionStore.subscribe),
    so a test can wait until a watcher is really listening before it publishes."""

    def __init__(self, server: WeightServer) -> None:
        self._changed = threading.Condition()
        self.active = 0
        self.total = 0
        subscribe = server.store.subscribe

        def instrumented(listener: Callable) -> Callable[[], None]:
            unsubscribe = subscribe(listener)
            with self._changed:
                self.active += 1
                self.total += 1
                self._changed.notify_all()

            def instrumented_unsubscribe() -> None:
                unsubscribe()
                with self._changed:
                    self.active -= 1
                    self._changed.notify_all()

            return instrumented_unsubscribe

        server.store.subscribe = instrumented  # type: ignore[method-assign]

    def wait_for(self, predicate: Callable[[Subscriptions], bool], timeout: float = WAIT) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: predicate(self), timeout), (
                f"subscriptions: active={self.active} total={self.total}"
            )


class Watcher:
    """Consumes client.watch(...) in a thread; events (or the error that ended it) go to a queue."""

    def __init__(self, address: str, model: str = MODEL, since: int = 0) -> None:
        self.client = WeightClient(address)
        self.events: queue.Queue[VersionEvent | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._iterator = self.client.watch(model, since=since, timeout=WATCH_DEADLINE)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._iterator:
                self.events.put(event)
                if self._stop.is_set():
                    break
        except BaseException as exc:
            if not self._stop.is_set():
                self.events.put(exc)

    def take(self, count: int) -> list[VersionEvent]:
        taken = []
        for _ in range(count):
            try:
                item = self.events.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"watcher got {[e.version for e in taken]} and then nothing for {WAIT}s")
            if isinstance(item, BaseException):
                raise item
            taken.append(item)
        return taken

    def assert_no_more(self) -> None:
        assert self.events.empty(), f"unexpected extra event {self.events.queue[0]!r}"

    def close(self) -> None:
        self._stop.set()
        self.client.close()  # cancels the watch call; the thread's iterator ends
        self._thread.join(WAIT)
        assert not self._thread.is_alive()


@pytest.fixture
def subscriptions(server) -> Subscriptions:
    return Subscriptions(server)


@pytest.fixture
def watchers(server) -> Iterator[Callable[..., Watcher]]:
    started: list[Watcher] = []

    def factory(model: str = MODEL, since: int = 0, address: str | None = None) -> Watcher:
        watcher = Watcher(address or server.address, model, since)
        started.append(watcher)
        return watcher

    yield factory
    for watcher in started:
        watcher.close()


def weights(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(i))}


# ---------------------------------------------------------------------- tests
def test_watch_on_empty_model_waits_for_the_first_version(client, subscriptions, watchers) -> None:
    watcher = watchers(since=0)
    subscriptions.wait_for(lambda s: s.active == 1)
    watcher.assert_no_more()  # nothing to report yet: the model has no version

    version = client.publish(weights(1), model=MODEL, metadata={"step": "1"})
    (event,) = watcher.take(1)
    assert event.version == version == 1
    assert event.gap is False
    assert event.info.model == MODEL
    assert event.info.metadata == {"step": "1"}
    assert event.info.xxh3 == client.latest(MODEL).xxh3  # its sha256 may still be being computed
    assert [t.name for t in event.info.tensors] == ["w"]

    client.publish(weights(2), model=MODEL)
    assert [e.version for e in watcher.take(1)] == [2]


def test_watch_under_rapid_publishes_misses_nothing(server, subscriptions, watchers) -> None:
    watcher = watchers(since=0)
    subscriptions.wait_for(lambda s: s.active == 1)
    published: list[int] = []
    errors: list[BaseException] = []

    def publisher() -> None:
        try:
            with WeightClient(server.address) as c:
                for i in range(1, 51):
                    published.append(c.publish(weights(i), model=MODEL))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=publisher)
    thread.start()
    events = watcher.take(50)
    thread.join(WAIT)
    assert not errors
    assert published == list(range(1, 51))
    # Default keep=3: most of these were evicted long before the watcher read them, yet
    # every one is reported, in order, with no gap.
    assert [e.version for e in events] == list(range(1, 51))
    assert not any(e.gap for e in events)
    watcher.assert_no_more()


def test_late_subscriber_gets_missed_retained_versions_then_live_ones(client, subscriptions, watchers) -> None:
    for i in range(1, 6):
        client.publish(weights(i), model=MODEL)  # keep=3: 3, 4, 5 retained
    watcher = watchers(since=3)
    backlog = watcher.take(2)
    assert [(e.version, e.gap) for e in backlog] == [(4, False), (5, False)]
    subscriptions.wait_for(lambda s: s.active == 1)
    watcher.assert_no_more()

    client.publish(weights(6), model=MODEL)
    client.publish(weights(7), model=MODEL)
    assert [(e.version, e.gap) for e in watcher.take(2)] == [(6, False), (7, False)]
    watcher.assert_no_more()


def test_late_subscriber_since_latest_gets_only_live_versions(client, subscriptions, watchers) -> None:
    for i in range(1, 4):
        client.publish(weights(i), model=MODEL)
    watcher = watchers(since=3)
    subscriptions.wait_for(lambda s: s.active == 1)
    watcher.assert_no_more()
    client.publish(weights(4), model=MODEL)
    assert [(e.version, e.gap) for e in watcher.take(1)] == [(4, False)]


def test_late_subscriber_with_evicted_versions_sees_a_gap_once(make_server) -> None:
    server = make_server(keep=2)
    subscriptions = Subscriptions(server)
    with WeightClient(server.address) as client:
        for i in range(1, 6):
            client.publish(weights(i), model=MODEL)  # 1-3 evicted, 4-5 retained
        watcher = Watcher(server.address, since=1)  # missed 2 and 3 for good
        try:
            backlog = watcher.take(2)
            assert [(e.version, e.gap) for e in backlog] == [(4, True), (5, False)]
            subscriptions.wait_for(lambda s: s.active == 1)
            client.publish(weights(6), model=MODEL)
            client.publish(weights(7), model=MODEL)
            assert [(e.version, e.gap) for e in watcher.take(2)] == [(6, False), (7, False)]
            watcher.assert_no_more()
        finally:
            watcher.close()

        # since=5: every evicted version is at or before the cursor -> no gap.
        watcher = Watcher(server.address, since=5)
        try:
            assert [(e.version, e.gap) for e in watcher.take(2)] == [(6, False), (7, False)]
        finally:
            watcher.close()


def test_watch_after_delete_reports_a_gap(client, watchers) -> None:
    for i in range(1, 4):
        client.publish(weights(i), model=MODEL)
    client.delete(MODEL, 2)
    watcher = watchers(since=1)
    assert [(e.version, e.gap) for e in watcher.take(1)] == [(3, True)]


def test_two_watchers_both_see_every_version(server, client, subscriptions, watchers) -> None:
    first = watchers(since=0)
    second = watchers(since=0)
    subscriptions.wait_for(lambda s: s.active == 2)
    for i in range(1, 21):
        client.publish(weights(i), model=MODEL)
    assert [e.version for e in first.take(20)] == list(range(1, 21))
    assert [e.version for e in second.take(20)] == list(range(1, 21))
    first.assert_no_more()
    second.assert_no_more()


def test_watchers_of_other_models_see_nothing(client, subscriptions, watchers) -> None:
    mine = watchers(model="mine")
    theirs = watchers(model="theirs")
    subscriptions.wait_for(lambda s: s.active == 2)
    client.publish(weights(1), model="theirs")
    client.publish(weights(1), model="mine")
    client.publish(weights(2), model="mine")
    assert [(e.info.model, e.version) for e in mine.take(2)] == [("mine", 1), ("mine", 2)]
    assert [(e.info.model, e.version) for e in theirs.take(1)] == [("theirs", 1)]
    theirs.assert_no_more()


def test_closing_a_watch_frees_it_and_the_server_keeps_serving(server, client, other_client, subscriptions) -> None:
    client.publish(weights(1), model=MODEL)
    events = other_client.watch(MODEL, since=0, timeout=WATCH_DEADLINE)
    assert next(events).version == 1
    subscriptions.wait_for(lambda s: s.active == 1)

    events.close()  # cancels the call
    subscriptions.wait_for(lambda s: s.active == 0)  # the server dropped its subscription

    # The server (and the same client's channel) keep working.
    assert client.publish(weights(2), model=MODEL) == 2
    result = other_client.fetch(MODEL)
    assert result is not None
    assert result.version == 2
    again = other_client.watch(MODEL, since=1, timeout=WATCH_DEADLINE)
    try:
        assert next(again).version == 2
    finally:
        again.close()
    subscriptions.wait_for(lambda s: s.active == 0 and s.total == 2)


def test_many_cancelled_watches_leave_no_subscriptions(server, client, subscriptions) -> None:
    client.publish(weights(1), model=MODEL)
    for _ in range(20):
        with WeightClient(server.address) as c:
            events = c.watch(MODEL, since=0, timeout=WATCH_DEADLINE)
            assert next(events).version == 1
            events.close()
    subscriptions.wait_for(lambda s: s.total == 20 and s.active == 0)
    assert client.publish(weights(2), model=MODEL) == 2


def test_watch_deadline_ends_the_stream(client, subscriptions) -> None:
    from weightclient import DeadlineExceeded

    client.publish(weights(1), model=MODEL)
    events = client.watch(MODEL, since=1, timeout=0.3)
    with pytest.raises(DeadlineExceeded):
        next(events)
    subscriptions.wait_for(lambda s: s.active == 0 and s.total == 1)


def test_stopping_the_server_ends_open_watches_with_unavailable_and_logs_no_error(caplog) -> None:
    """A server stopping with watchers subscribed ends their streams with UNAVAILABLE (so they
    resubscribe) instead of leaving gRPC to cancel the handlers, which logged an ERROR each."""
    from weightserver import ServerConfig
    from weightserver.v1 import weights_pb2 as pb
    from weightserver.v1 import weights_pb2_grpc as pb_grpc

    server = WeightServer(ServerConfig(host="127.0.0.1", port=0, shm_dir=None, bulk_port=None)).start()
    channel = grpc.insecure_channel(server.address)
    streams = [pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model=MODEL), timeout=WATCH_DEADLINE)]
    streams.append(pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model="critic"), timeout=WATCH_DEADLINE))
    for stream in streams:
        stream.initial_metadata()  # subscribed
    with caplog.at_level("ERROR"):
        server.stop(grace=5)
    for stream in streams:
        with pytest.raises(grpc.RpcError) as raised:
            next(stream)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value
        assert "shutting down" in raised.value.details()
    channel.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= 40] == []


def watch_in_a_thread(events: Iterator[VersionEvent]) -> tuple[threading.Thread, queue.Queue]:
    """Steps `events` in a thread; each event, then "ended" (or the error that ended it), goes to the queue."""
    seen: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            for event in events:
                seen.put(event)
            seen.put("ended")
        except BaseException as exc:
            seen.put(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, seen


def test_cancel_from_another_thread_ends_a_watch_at_once_and_quietly(
    server, client, other_client, subscriptions, caplog
) -> None:
    """`cancel()` ends a Watch blocked in another thread at once: its iterator ends (no error, no
    "resubscribing"), the server drops its subscription and the client stays usable. Before, a
    watch could be ended only by `close()` from the thread stepping it (ValueError from any other:
    "generator already executing") or by closing its client; a stopped follower kept its stream
    until the call's deadline."""
    caplog.set_level("INFO", logger="weightclient")
    client.publish(weights(1), model=MODEL)
    events = other_client.watch(MODEL, since=0, timeout=WATCH_DEADLINE)
    thread, seen = watch_in_a_thread(events)
    assert seen.get(timeout=WAIT).version == 1
    subscriptions.wait_for(lambda s: s.active == 1)  # and the thread waits for v2

    events.cancel()
    thread.join(1.0)
    assert not thread.is_alive()
    assert seen.get_nowait() == "ended"
    subscriptions.wait_for(lambda s: s.active == 0, timeout=1.0)
    events.cancel()  # again: nothing more
    assert [r.getMessage() for r in caplog.records if "watch of" in r.getMessage()] == []
    assert other_client.latest(MODEL).version == 1  # its client is still open

    cancelled = other_client.watch(MODEL, since=0, timeout=WATCH_DEADLINE)
    cancelled.cancel()  # before its first step: it never subscribes
    assert list(cancelled) == []
    assert subscriptions.total == 1


def test_cancel_ends_a_watch_waiting_to_resubscribe(make_server, caplog) -> None:
    """A watch whose server went away waits between attempts to resubscribe; `cancel()` ends that
    wait too, at once."""
    server = make_server()
    caplog.set_level("WARNING", logger="weightclient")
    with WeightClient(server.address, retry_seconds=60) as client:
        client.publish(weights(1), model=MODEL)
        events = client.watch(MODEL, since=0)
        thread, seen = watch_in_a_thread(events)
        assert seen.get(timeout=WAIT).version == 1
        server.stop(grace=0)
        waited = time.monotonic() + WAIT
        while not any("resubscribing" in r.getMessage() for r in caplog.records) and time.monotonic() < waited:
            time.sleep(0.05)
        time.sleep(0.5)  # well into its attempts
        events.cancel()
        thread.join(1.0)
        assert not thread.is_alive()
        assert seen.get_nowait() == "ended"
