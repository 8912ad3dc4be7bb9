"""SpareUploads when the client closes: a publish never waits on a spare's set-up that closing dropped."""

from __future__ import annotations

import threading

from weightclient.core.publish import SpareUploads
from weightclient.core.retry import NEVER
from weightclient.transports.mock import MockTransport
from weightserver.v1 import weights_pb2 as pb


def _spares_with_one_queued() -> tuple[SpareUploads, threading.Event, MockTransport]:
    """A SpareUploads whose one thread is held by a Negotiate for model "a", with "b"'s set-up queued behind it."""
    held, release = threading.Event(), threading.Event()

    def negotiate(seconds, kinds, publish):
        held.set()
        release.wait(10)
        return pb.NegotiateResponse()  # no transport: no spare, as from a server that offers none

    spares, transport = SpareUploads(negotiate), MockTransport(None, "shm")
    spares.refill("a", 1024, transport)
    assert held.wait(5)
    spares.refill("b", 1024, transport)  # queued: the one thread is busy with "a"
    return spares, release, transport


def _taken_within(seconds: float, spares: SpareUploads, transport: MockTransport, started: threading.Event) -> bool:
    done = threading.Event()

    def take() -> None:
        started.set()
        spares.take("b", 1024, [transport], NEVER)  # no deadline: it waits as long as the set-up does
        done.set()

    threading.Thread(target=take, daemon=True).start()
    return done.wait(seconds)


def test_a_publish_after_close_does_not_wait_for_a_set_up_that_closing_dropped():
    """close() takes "b"'s queued set-up off the queue (cancelled); a take after it returns at once.
    Before, it waited for that future forever: `concurrent.futures.wait` is told of a cancel only when
    a worker dequeues the future, and no worker ever does."""
    spares, release, transport = _spares_with_one_queued()
    try:
        spares.close()
        spares.close()  # a client closed twice (a `with` block, then close()) closes its spares twice
        assert _taken_within(5, spares, transport, threading.Event())
    finally:
        release.set()


def test_a_publish_waiting_for_a_spare_is_let_go_when_the_client_closes():
    """A take already waiting for "b"'s queued set-up when close() drops it is told, and returns."""
    spares, release, transport = _spares_with_one_queued()
    started = threading.Event()
    try:
        closing = threading.Timer(0.2, spares.close)
        closing.start()
        assert _taken_within(5, spares, transport, started) and started.is_set()
        closing.join()
    finally:
        release.set()
