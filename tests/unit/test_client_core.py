"""The client's fetch, publish, retry, deadline and fallback logic against the in-memory server
(weightclient.transports.mock): no sockets."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

import pytest
import xxhash

from weightclient import DeadlineExceeded, IntegrityError, ServerUnavailable, WeightServiceClient
from weightclient.core.background import BackgroundPublisher
from weightclient.core.retry import RetryPolicy
from weightclient.transports.mock import MockServer

DATA = bytes(range(256)) * 64
FAST_RETRY = RetryPolicy(first=0.001, longest=0.002)


def client_of(server: MockServer, address: str = "mock", **options) -> WeightServiceClient:
    return WeightServiceClient(address, connect=server.connect, retry=FAST_RETRY, **options)


def test_a_fetch_goes_over_the_fast_transport_the_server_picks():
    server = MockServer()
    server.commit("policy", DATA)
    with client_of(server) as client:
        fetched = client.fetch_bytes("policy")
    assert bytes(fetched.data) == DATA and fetched.stats.transport == "bulk" and fetched.info.version == 1
    assert server.calls == ["Negotiate", "bulk.receive"]


def test_bytes_that_fail_their_digest_fall_back_to_the_stream_and_the_transport_rests():
    server = MockServer()
    server.commit("policy", DATA)
    server.corrupt.add("bulk")
    with client_of(server) as client:
        fetched = client.fetch_bytes("policy")
        assert bytes(fetched.data) == DATA and fetched.stats.transport == "stream"
        assert client.transports.usable("bulk") is False
        assert client.fetch_bytes("policy", version=1).stats.transport == "stream"  # bulk rests
    assert server.calls == ["Negotiate", "bulk.receive", "Fetch", "stream.receive", "Fetch", "stream.receive"]


def test_the_stream_is_the_last_transport_so_its_bad_bytes_raise():
    server = MockServer()
    server.commit("policy", DATA)
    server.corrupt.add("stream")
    with client_of(server) as client:
        with pytest.raises(IntegrityError, match="xxh3"):
            client.fetch_bytes("policy", transport="stream")
        server.corrupt.add("bulk")
        with pytest.raises(IntegrityError, match="xxh3"):
            client.fetch_bytes("policy", transport="bulk")
    assert server.calls[-3:] == ["bulk.receive", "Fetch", "stream.receive"]


def test_the_fallback_asks_the_stream_for_exactly_the_version_negotiated():
    server = MockServer()
    server.commit("policy", DATA)
    server.corrupt.add("bulk")
    with client_of(server) as client:
        original = server.Negotiate

        def negotiate_then_publish(request, **kwargs):
            answer = original(request, **kwargs)
            server.commit("policy", DATA[::-1])  # v2 lands between the answer and the fallback
            return answer

        server.Negotiate = negotiate_then_publish
        fetched = client.fetch_bytes("policy")
    assert fetched.info.version == 1 and bytes(fetched.data) == DATA


def test_an_up_to_date_fetch_moves_nothing():
    server = MockServer()
    server.commit("policy", DATA)
    with client_of(server) as client:
        assert client.fetch_bytes("policy", newer_than=1) is None
        assert client.fetch_bytes("policy", newer_than=1, transport="stream") is None
    assert server.calls == ["Negotiate", "Fetch"]


def test_idempotent_calls_retry_while_the_server_is_unavailable():
    server = MockServer()
    server.commit("policy", DATA)
    server.fail["GetLatest"] = [ServerUnavailable("down"), ServerUnavailable("still down")]
    with client_of(server) as client:
        assert client.latest("policy").version == 1
        assert server.calls.count("GetLatest") == 3
        server.fail["GetLatest"] = [ServerUnavailable("down")]
        with pytest.raises(ServerUnavailable):
            client.latest("policy", retry=False)


def test_retries_end_at_the_callers_deadline():
    server = MockServer()
    server.commit("policy", DATA)
    server.fail["Negotiate"] = [ServerUnavailable("down")] * 10_000
    slow = RetryPolicy(first=0.05, longest=0.05, jitter=0.0)
    with WeightServiceClient("mock", connect=server.connect, retry=slow) as client:
        began = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.fetch_bytes("policy", timeout=0.3)
        assert 0.2 <= time.monotonic() - began < 0.6
        assert 3 <= server.calls.count("Negotiate") <= 7


def test_a_failed_server_is_left_for_the_next_address_at_once():
    server = MockServer()
    server.commit("policy", DATA)
    server.fail["GetLatest"] = [ServerUnavailable("down")]
    with client_of(server, "a:1,b:2") as client:
        assert client.latest("policy", retry=False).version == 1
        assert client.address == "b:2"


def test_a_retried_call_moves_on_to_the_next_address_at_once():
    server = MockServer()
    server.commit("policy", DATA)
    server.fail["GetLatest"] = [ServerUnavailable("down")]
    started = time.monotonic()
    with WeightServiceClient("a:1,b:2", connect=server.connect, retry=RetryPolicy(first=1.0)) as client:
        assert client.latest("policy").version == 1 and client.address == "b:2"
    assert time.monotonic() - started < 0.5


def test_without_retry_each_address_gets_its_share_and_the_call_never_outlasts_its_deadline():
    server = MockServer()
    server.commit("policy", DATA)
    given: list[float | None] = []
    original = server.GetLatest

    def stalled_first(request, timeout=None, **kwargs):
        given.append(timeout)
        if len(given) == 1:
            time.sleep(timeout)
            raise DeadlineExceeded("stalled")
        return original(request, **kwargs)

    server.GetLatest = stalled_first
    with client_of(server, "a:1,b:2") as client:
        began = time.monotonic()
        assert client.latest("policy", retry=False, timeout=1.0).version == 1
    assert given[0] == pytest.approx(0.5, abs=0.05)  # half of it for the first of two
    assert given[1] == pytest.approx(0.5, abs=0.1)  # what is left for the last
    assert time.monotonic() - began < 1.0 + 0.2


def test_a_publish_moves_its_bytes_over_the_fast_transport_and_commits_them_on_the_stream():
    server = MockServer()
    with client_of(server) as client:
        info = client.publish_bytes("policy", [memoryview(DATA[:100]), memoryview(DATA[100:])])
        assert info.version == 1 and info.xxh3 == xxhash.xxh3_128_hexdigest(DATA)
        assert client.publish_bytes("policy", DATA, transport="stream").version == 2
    assert server.calls[:3] == ["Negotiate", "bulk.upload", "Publish"]
    assert server.versions["policy"][1][1] == DATA


def test_a_publish_whose_fast_transport_fails_goes_over_the_stream():
    server = MockServer()
    with client_of(server) as client:
        original = client.transports.by_name["bulk"].upload

        def refused(*args, **kwargs):
            from weightclient.transports import TransportFailed

            raise TransportFailed("refused")

        client.transports.by_name["bulk"].upload = refused
        assert client.publish_bytes("policy", DATA).version == 1
        assert client.transports.usable("bulk") is False
        client.transports.by_name["bulk"].upload = original
    assert server.versions["policy"][0][1] == DATA


def test_a_misspelt_tls_option_is_a_type_error_even_with_a_stand_in_network():
    with pytest.raises(TypeError, match="tls_cret"):
        client_of(MockServer(), tls_cret="client.pem")


def sending(snapshot: bytes) -> tuple[BackgroundPublisher, Future, threading.Event, list[bytes]]:
    """A background publisher held in its first send (of `snapshot`) until the event is set; the list of
    what it sent. Each send's version is the count of sends so far."""
    entered, release = threading.Event(), threading.Event()
    sent: list[bytes] = []

    def send(snapshot, **options) -> int:
        sent.append(bytes(snapshot["m"]))
        if len(sent) == 1:
            entered.set()
            release.wait(30)
        return len(sent)

    publisher = BackgroundPublisher(send)
    first = publisher.submit({"m": memoryview(snapshot)})
    assert entered.wait(30)
    return publisher, first, release, sent


def test_a_child_forked_during_a_background_publish_flushes_and_publishes_its_own():
    """A process forked (a data loader, a collector) while the background publisher sends a snapshot
    starts empty: its flush and close return at once, and its own submits are sent. Before, the child
    kept the parent's "busy" with no thread to end it: its flush waited forever (so did close)."""
    publisher, first, release, sent = sending(b"parent")
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what went wrong
        code = 1
        try:
            if not publisher.flush(timeout=5):
                code = 2
            elif publisher.submit({"m": memoryview(b"child")}).result(timeout=5) != 2 or sent[-1] != b"child":
                code = 3
            else:
                publisher.close(timeout=5)
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    release.set()
    assert first.result(timeout=30) == 1 and sent == [b"parent"]
    publisher.close(timeout=30)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_spare_upload_unused_for_its_time_is_let_go(monkeypatch):
    """An upload set up ahead (a spare: for shared memory, a mapping of a model's size of the server's
    memory) is let go once unused for SPARE_SECONDS, as docs/internals/transports.md says, even if no
    publish comes again. Before, an expired spare was let go only by the model's next publish, so a
    trainer that had published its last version held the mapping until it closed its client."""
    import weightclient.core.publish as publish

    monkeypatch.setattr(publish, "SPARE_SECONDS", 0.2)
    server, released = MockServer(), threading.Event()
    with client_of(server) as client:
        bulk = client.transports.by_name["bulk"]
        monkeypatch.setattr(bulk, "prepare", lambda payload: None)
        monkeypatch.setattr(bulk, "release", lambda payload: released.set())
        assert client.publish_bytes("policy", DATA).version == 1  # its successor is set up meanwhile
        assert released.wait(10), "the spare was never let go"
        assert server.calls.count("Negotiate") == 2  # the publish's, then the spare's


def test_a_background_publish_cancelled_while_it_waits_is_not_sent_and_the_others_resolve():
    """`future.cancel()` on a publish still waiting its turn succeeds (a concurrent.futures.Future):
    then it is not sent, and the publishes coalesced with it still resolve. Before, the cancelled
    future's publish went out anyway, and setting its result raised InvalidStateError in the
    publisher's thread, so the futures after it in the same send never resolved (a wait forever)."""
    publisher, first, release, sent = sending(b"first")
    given_up, newer = publisher.submit({"m": memoryview(b"given up")}), publisher.submit({"m": memoryview(b"newer")})
    assert given_up.cancel()
    release.set()
    assert first.result(timeout=30) == 1 and newer.result(timeout=30) == 2 and newer.superseded is False
    alone = publisher.submit({"m": memoryview(b"alone")})
    cancelled = alone.cancel()  # (refused if the thread took it already: then it is sent)
    assert publisher.flush(timeout=30)
    assert sent == [b"first", b"newer"] + ([] if cancelled else [b"alone"])
    publisher.close(timeout=30)


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "localhost:0", "a:1,b:65536"])
def test_an_address_whose_port_is_out_of_range_is_refused_at_once(address):
    """Before, the client was made, and each call retried for 30 s against the port modulo 65536."""
    with pytest.raises(ValueError, match="is not one"):
        WeightServiceClient(address)
