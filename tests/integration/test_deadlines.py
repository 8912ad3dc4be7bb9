"""A call's timeout is its deadline, refetches included: when a fetch must be made again (the
caller's base differs from the server's, or the base a delta was applied to changed since it
was fetched), the second fetch gets what is left of the caller's timeout, not a new one.

Each test makes the first fetch take most of the timeout and then the server fall silent: a
real server behind a loopback proxy whose replies stop, triggered by the client's own log line
that announces the refetch (a handler that sleeps, then drops the replies)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch

from tests.integration.test_exactly_once import ReplyDroppingProxy, proxy_to
from weightclient import DeadlineExceeded, ServerUnavailable, WeightClient

MODEL = "policy"
TIMEOUT = 3.0
FIRST_FETCH_SECONDS = 2.0  # spent before the refetch starts, out of TIMEOUT
SLACK = 0.75  # a loaded machine's scheduling, on top of the deadline


def weights(step: int) -> dict[str, torch.Tensor]:
    """`body` never changes; `head` changes every step (a delta carries only it)."""
    return {"body": torch.arange(4096, dtype=torch.float32), "head": torch.full((8,), float(step))}


class SilenceOnRefetch(logging.Handler):
    """When the client logs `message` (it is about to fetch again): sleep, as a slow first
    fetch would have, then make the server behind `proxy` stop answering."""

    def __init__(self, proxy: ReplyDroppingProxy, message: str) -> None:
        super().__init__(logging.INFO)
        self.proxy, self.message, self.seen = proxy, message, 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.message in record.getMessage():
            self.seen += 1
            time.sleep(FIRST_FETCH_SECONDS)
            self.proxy.drop_replies()


@pytest.fixture
def silence(make_server) -> Iterator:
    """`silence(message)`: (client through a proxy to a server holding v1 and v2, handler)."""
    server = make_server()
    with WeightClient(server.address) as trainer:
        trainer.publish(weights(1), model=MODEL, transport="stream")
        trainer.publish(weights(2), model=MODEL, transport="stream")
    installed: list[tuple[logging.Logger, SilenceOnRefetch]] = []
    with proxy_to(server.port) as proxy, WeightClient(proxy.address) as client:

        def factory(logger: str, message: str) -> tuple[WeightClient, SilenceOnRefetch]:
            handler = SilenceOnRefetch(proxy, message)
            target = logging.getLogger(logger)
            target.addHandler(handler)
            target.setLevel(logging.INFO)
            installed.append((target, handler))
            return client, handler

        try:
            yield factory
        finally:
            for target, handler in installed:
                target.removeHandler(handler)
                target.setLevel(logging.NOTSET)


def timed_out(call) -> float:
    """Seconds until `call` failed for want of an answer (a stalled server ends a call as
    DeadlineExceeded, one that never finished its handshake as ServerUnavailable)."""
    began = time.monotonic()
    with pytest.raises((DeadlineExceeded, ServerUnavailable)):
        call()
    return time.monotonic() - began


def test_a_refetch_for_a_base_that_differs_gets_what_is_left_of_the_deadline(silence):
    client, handler = silence("weightclient.core.fetch", "differs from the caller's; fetching it whole")
    spent = timed_out(
        lambda: client.fetch_bytes(
            MODEL, version=2, base_version=1, base_xxh3="0" * 32, transport="stream", timeout=TIMEOUT, retry=False
        )
    )
    assert handler.seen == 1  # the refetch happened, after FIRST_FETCH_SECONDS
    assert spent < TIMEOUT + SLACK, f"fetch(timeout={TIMEOUT}) took {spent:.2f}s"


def test_a_refetch_for_a_changed_base_gets_what_is_left_of_the_deadline(silence):
    client, handler = silence("weightclient.client", "changed since it was fetched; fetching whole")
    base = client.fetch(MODEL, version=1, transport="stream")
    base.tensors["body"].add_(1.0)  # the caller changed its copy: the delta cannot complete it
    spent = timed_out(lambda: client.fetch(MODEL, version=2, base=base, transport="stream", timeout=TIMEOUT))
    assert handler.seen == 1
    assert spent < TIMEOUT + SLACK, f"fetch(timeout={TIMEOUT}) took {spent:.2f}s"


@pytest.mark.parametrize("method", ["fetch_bytes", "fetch"])
def test_a_fetch_that_gives_no_timeout_has_the_clients(make_server, method):
    """`WeightClient(timeout=...)` is the deadline of a fetch that gives none. It was
    `retry_seconds` (30 s by default) instead: a 4 GiB stream fetch on a client made with
    timeout=540 (tests/integration/test_large_model.py) failed at 30 s. Here the client's
    timeout is the longer of the two, so the old deadline shows as a failure at 1 s."""
    server = make_server()
    with WeightClient(server.address) as trainer:
        trainer.publish(weights(1), model=MODEL, transport="stream")
    with proxy_to(server.port) as proxy, WeightClient(proxy.address, timeout=TIMEOUT, retry_seconds=1.0) as client:
        assert client.fetch_bytes(MODEL, version=1, transport="stream") is not None  # the channel up
        proxy.drop_replies()
        spent = timed_out(lambda: getattr(client, method)(MODEL, version=1, transport="stream"))
    assert TIMEOUT - SLACK < spent < TIMEOUT + SLACK, f"{method}() on WeightClient(timeout={TIMEOUT}) took {spent:.2f}s"


def test_a_fetch_with_stall_finds_its_version_within_its_timeout(make_server):
    """With `stall=`, the timeout still bounds finding the version (the stream's head); only the
    transfer after it runs while its bytes keep coming. Over the stream, the Fetch call's head
    was waited for as long as `stall` instead: a server that fell silent held a fetch with
    timeout=1 for the 8 s of its stall."""
    server = make_server()
    with WeightClient(server.address) as trainer:
        trainer.publish(weights(1), model=MODEL, transport="stream")
    with proxy_to(server.port) as proxy, WeightClient(proxy.address) as client:
        assert client.fetch_bytes(MODEL, version=1, transport="stream") is not None  # the channel up
        proxy.drop_replies()
        spent = timed_out(
            lambda: client.fetch_bytes(MODEL, version=1, transport="stream", timeout=1.0, stall=8.0, retry=False)
        )
    assert spent < 1.0 + SLACK, f"fetch(timeout=1, stall=8) took {spent:.2f}s"
