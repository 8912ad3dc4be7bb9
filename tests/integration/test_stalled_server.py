"""A collector's updater facing a server that stops answering without going away: a real
server process SIGSTOPped. Every call the updater makes has `update_timeout` as its deadline, and
so has each wait for a transfer's bytes, so an update and `.lag` return promptly, the policy keeps
its weights, the outage is reported as for a server that is down, and the updater catches up once
the server answers again. A transfer whose bytes keep coming may take longer: it lands."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from waiting import sigstop, wait_until

from weightclient import DeadlineExceeded, WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightclient.transports import bulk as bulk_transport
from weightserver.process import ServerProcess
from weightserver.protocol import framing

MODEL = "policy"
UPDATE_TIMEOUT = 1.0
STOP_SECONDS = 10.0  # the server is resumed after this even if a test still waits for it
PROMPT = 5.0  # "returns promptly": well under STOP_SECONDS, generous for a loaded machine
CATCH_UP = 30.0


@pytest.fixture
def proc(tmp_path) -> Iterator[ServerProcess]:
    server = ServerProcess("--data-dir", str(tmp_path / "data"))
    server.start()
    try:
        yield server
    finally:
        with_resumed(server)
        server.kill()


def with_resumed(server: ServerProcess) -> None:
    if server.process is not None and server.process.poll() is None:
        os.kill(server.process.pid, signal.SIGCONT)


def stop(server: ServerProcess) -> threading.Timer:
    """SIGSTOP the server process (its port accepts connections, nothing answers) and resume
    it after STOP_SECONDS, so that a call that waits for the server fails the test on its
    timing instead of hanging it. Cancel the timer to resume it sooner."""
    sigstop(server.process.pid)
    timer = threading.Timer(STOP_SECONDS, with_resumed, (server,))
    timer.start()
    return timer


@contextmanager
def stopped(server: ServerProcess) -> Iterator[None]:
    """The server stopped for the block (at most STOP_SECONDS)."""
    timer = stop(server)
    try:
        yield
    finally:
        timer.cancel()
        with_resumed(server)


def linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    theirs = b.state_dict()
    return all(torch.equal(t, theirs[name]) for name, t in a.state_dict().items())


def timed(call) -> tuple[object, float]:
    began = time.monotonic()
    result = call()
    return result, time.monotonic() - began


def updater_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "weightclient.torchrl.grpc_updaters" and r.levelno >= 30
    ]


def run_through_the_stop(updater: GrpcLocalWeightUpdater, seconds: float = 4.0) -> tuple[int, float]:
    """Updates and `lag` reads, as a collector makes them between batches, for `seconds`:
    how many, and the longest any one took."""
    calls, longest = 0, 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, spent = timed(updater)
        lag, spent_on_lag = timed(lambda: updater.lag)
        assert lag is None or not updater.server_available  # never a number from a stopped server
        longest = max(longest, spent, spent_on_lag)
        calls += 1
        time.sleep(0.02)
    return calls, longest


@pytest.mark.parametrize("transport", ["stream", "auto"])  # auto on the server's host: shared memory
def test_updates_return_promptly_keep_the_weights_and_catch_up(proc, caplog, transport):
    policy = linear(0)
    with WeightClient(proc.address) as trainer:
        trainer.publish(linear(1), model=MODEL)
        options = {"transport": transport, "update_timeout": UPDATE_TIMEOUT}
        updater = GrpcLocalWeightUpdater(proc.address, policy=policy, **options)
        updater()
        assert updater.version == 1 and updater.last_fetch.transport == ("shm" if transport == "auto" else "stream")
        trainer.publish(linear(2), model=MODEL)  # waits on the server: the stop comes first

        caplog.clear()
        with caplog.at_level(logging.WARNING), stopped(proc):
            _, spent = timed(updater)
            assert spent < PROMPT  # not the whole stop
            assert updater.version == 1 and same(policy, linear(1))
            assert not updater.server_available
            assert "unavailable" in updater.status and f"{UPDATE_TIMEOUT:g}s" in updater.status
            calls, longest = run_through_the_stop(updater)
            assert calls > 10 and longest < PROMPT
            assert updater.version == 1 and same(policy, linear(1)) and updater.lag is None
        warnings = updater_warnings(caplog)
        assert len(warnings) == 1 and "update_timeout" in warnings[0], warnings  # once per outage

        trainer.publish(linear(3), model=MODEL)
        wait_until(lambda: (updater(), updater.version)[1] == 3, timeout=CATCH_UP)
        assert updater.server_available and updater.lag == 0 and same(policy, linear(3))
        updater.client.close()


def test_a_stream_that_stalls_part_way_is_bounded_and_the_policy_keeps_its_weights(proc, monkeypatch):
    """The server stops after the first chunk of a 64 MiB version has arrived: the wait for the
    next is bounded."""
    torch.manual_seed(0)
    policy, trained = torch.nn.Linear(4096, 4096), [torch.nn.Linear(4096, 4096) for _ in range(2)]
    timers: list[threading.Timer] = []
    original = framing.receive_chunks

    def stop_after_the_first_chunk(chunks, into, progress=None):
        def counted():
            for i, chunk in enumerate(chunks):
                if i == 1 and not timers:
                    timers.append(stop(proc))
                yield chunk

        original(counted(), into, progress)

    with WeightClient(proc.address) as trainer:
        trainer.publish(trained[0], model=MODEL)
        updater = GrpcLocalWeightUpdater(
            proc.address, policy=policy, transport="stream", delta=False, update_timeout=UPDATE_TIMEOUT
        )
        updater()
        assert updater.version == 1 and same(policy, trained[0])
        trainer.publish(trained[1], model=MODEL)
        monkeypatch.setattr(framing, "receive_chunks", stop_after_the_first_chunk)
        try:
            _, spent = timed(updater)
            assert timers, "the fetch never reached its second chunk"
            assert spent < PROMPT and not updater.server_available
            assert updater.version == 1 and same(policy, trained[0])
        finally:
            for timer in timers:
                timer.cancel()
            with_resumed(proc)
        wait_until(lambda: (updater(), updater.version)[1] == 2, timeout=CATCH_UP)
        assert same(policy, trained[1])
        updater.client.close()


def test_lag_answers_none_promptly_and_reports_the_outage(proc):
    with WeightClient(proc.address) as trainer:
        trainer.publish(linear(1), model=MODEL)
        updater = GrpcLocalWeightUpdater(proc.address, policy=linear(0), update_timeout=UPDATE_TIMEOUT)
        updater()
        assert updater.lag == 0
        with stopped(proc):
            lag, spent = timed(lambda: updater.lag)  # before any update noticed the stop
            assert lag is None and spent < PROMPT
            assert not updater.server_available and "unavailable" in updater.status
            # Noticed once: the next reads and updates back off instead of waiting again.
            _, spent = timed(lambda: [(updater.lag, updater()) for _ in range(20)])
            assert spent < PROMPT and updater.lag is None and updater.version == 1
        trainer.publish(linear(2), model=MODEL)
        wait_until(lambda: updater.lag == 1, timeout=CATCH_UP)  # lag alone notices the server is back
        assert updater.server_available
        updater()
        assert updater.version == 2 and updater.lag == 0
        updater.client.close()


def test_a_watching_updater_is_bounded_too_and_follows_again(proc, caplog):
    """watch=True: a stalled Watch stream announces nothing, so every `watch_confirm_seconds`
    the updater asks the server, and that call has the deadline too."""
    policy = linear(0)
    with WeightClient(proc.address) as trainer:
        trainer.publish(linear(1), model=MODEL)
        updater = GrpcLocalWeightUpdater(
            proc.address, policy=policy, watch=True, watch_confirm_seconds=0.2, update_timeout=UPDATE_TIMEOUT
        )
        updater()
        updater()  # starts following from v1
        wait_until(lambda: updater.following)

        caplog.clear()
        with caplog.at_level(logging.WARNING), stopped(proc):
            time.sleep(0.3)  # announcements stand in for the server for watch_confirm_seconds only
            calls, longest = run_through_the_stop(updater)
            assert calls > 10 and longest < PROMPT
            assert not updater.server_available and updater.lag is None
            assert updater.version == 1 and same(policy, linear(1))
        assert len(updater_warnings(caplog)) == 1

        trainer.publish(linear(2), model=MODEL)
        wait_until(lambda: (updater(), updater.version)[1] == 2, timeout=CATCH_UP)
        assert updater.server_available and same(policy, linear(2))
        # Following again: a new version is announced and applied.
        trainer.publish(linear(3), model=MODEL)
        wait_until(lambda: updater.announced == 3, timeout=CATCH_UP)
        updater()
        assert updater.version == 3 and updater.lag == 0 and same(policy, linear(3))
        updater.client.close()


def test_a_collector_keeps_collecting_through_a_stopped_server(proc):
    pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")
    from torchrl_models import actions_of, make_policy

    from tests.system.test_torchrl_integration import ATOL, catch_up, single_collector
    from weightclient.torchrl.scheme import GrpcWeightSyncScheme

    trained = [make_policy(seed) for seed in (1, 2, 3)]
    with WeightClient(proc.address) as trainer:
        trainer.publish(trained[0], model=MODEL)
        scheme = GrpcWeightSyncScheme(proc.address, update_timeout=UPDATE_TIMEOUT)
        collector = single_collector(make_policy(0), scheme)
        try:
            batches = iter(collector)
            collector.update_policy_weights_()
            assert scheme.version == 1
            trainer.publish(trained[1], model=MODEL)  # waits on the server: the stop comes first

            with stopped(proc):
                count, longest = 0, 0.0
                deadline = time.monotonic() + 4.0
                while time.monotonic() < deadline:
                    began = time.monotonic()
                    collector.update_policy_weights_()
                    batch = next(batches)
                    longest = max(longest, time.monotonic() - began)
                    assert torch.allclose(batch["action"], actions_of(trained[0], batch), atol=ATOL)
                    count += 1
                assert longest < PROMPT and count >= 10
                assert scheme.version == 1 and scheme.lag is None

            trainer.publish(trained[2], model=MODEL)
            catch_up(collector, scheme, batches, 3, trained[2], CATCH_UP)
        finally:
            collector.shutdown()
            scheme.puller.client.close()


def test_update_timeout_is_a_positive_deadline_and_the_scheme_passes_it_on(proc):
    for bad in (0, -1.0, None):
        with pytest.raises(ValueError, match="update_timeout"):
            GrpcLocalWeightUpdater(proc.address, update_timeout=bad)
    pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")
    from weightclient.torchrl.scheme import GrpcWeightSyncScheme

    assert GrpcWeightSyncScheme(proc.address, update_timeout=2.5).puller.update_timeout == 2.5
    with pytest.raises(ValueError, match="update_timeout"):  # puller= is the whole updater
        GrpcWeightSyncScheme(update_timeout=2.5, puller=GrpcLocalWeightUpdater(proc.address))


class SlowReads:
    """A bulk connection whose reads take 1 MiB at most, PAUSE apart: a slow link's pace."""

    PAUSE = 0.15

    def __init__(self, conn) -> None:
        self._conn = conn

    def __getattr__(self, name: str):
        return getattr(self._conn, name)

    def recv_into(self, view) -> int:
        time.sleep(self.PAUSE)
        return self._conn.recv_into(view[: 1 << 20])


@pytest.mark.parametrize("transport", ["stream", "bulk"])
def test_a_transfer_longer_than_update_timeout_lands_while_its_bytes_keep_coming(proc, monkeypatch, transport):
    """A 16 MiB version read at 1 MiB every 0.15 s (2.4 s) by an updater whose update_timeout is
    1 s: no wait for bytes is that long, so it lands, and the server never counts as down (before,
    the transfer's whole time was bounded: a version larger than update_timeout's worth of the link
    never landed, retried forever)."""
    if transport == "stream":
        original = framing.receive_chunks

        def slow_chunks(chunks, into, progress=None):
            def paced():
                for chunk in chunks:
                    time.sleep(SlowReads.PAUSE)
                    yield chunk

            original(paced(), into, progress)

        monkeypatch.setattr(framing, "receive_chunks", slow_chunks)
    else:
        connect = bulk_transport._connect
        monkeypatch.setattr(bulk_transport, "_connect", lambda *args: SlowReads(connect(*args)))
    trained = {"w": torch.arange(4 << 20, dtype=torch.float32)}
    policy = torch.nn.Module()
    policy.w = torch.nn.Parameter(torch.zeros(4 << 20))
    with WeightClient(proc.address) as trainer:
        trainer.publish(trained, model=MODEL)
    updater = GrpcLocalWeightUpdater(
        proc.address, policy=policy, transport=transport, delta=False, update_timeout=UPDATE_TIMEOUT
    )
    try:
        _, spent = timed(updater)
        assert updater.version == 1 and torch.equal(policy.w.detach(), trained["w"])
        assert updater.last_fetch.transport == transport and updater.server_available
        assert spent > 2 * UPDATE_TIMEOUT
    finally:
        updater.client.close()


def test_a_bulk_transfer_that_stalls_part_way_is_the_servers_outage_not_bulks(proc, monkeypatch, caplog):
    """The server stops after the first MiB of a 64 MiB version came over bulk: the wait for the
    next is cut to update_timeout, which reports the server as down (bulk is not put to rest and
    the stream asked instead, which would double the wait)."""
    torch.manual_seed(0)
    policy, trained = torch.nn.Linear(4096, 4096), [torch.nn.Linear(4096, 4096) for _ in range(2)]
    armed, timers = threading.Event(), []

    class StopAfterTheFirstRead(SlowReads):
        PAUSE = 0.0

        def recv_into(self, view) -> int:
            if armed.is_set() and not timers:
                n = super().recv_into(view)
                timers.append(stop(proc))
                return n
            return super().recv_into(view)

    connect = bulk_transport._connect
    monkeypatch.setattr(bulk_transport, "_connect", lambda *args: StopAfterTheFirstRead(connect(*args)))
    with WeightClient(proc.address) as trainer:
        trainer.publish(trained[0], model=MODEL)
        updater = GrpcLocalWeightUpdater(
            proc.address, policy=policy, transport="bulk", delta=False, update_timeout=UPDATE_TIMEOUT
        )
        updater()
        assert updater.version == 1 and updater.last_fetch.transport == "bulk"
        trainer.publish(trained[1], model=MODEL)
        armed.set()
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING):
                _, spent = timed(updater)
            assert timers, "the fetch never read its first MiB"
            assert spent < PROMPT and not updater.server_available
            assert updater.version == 1 and same(policy, trained[0])
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert not any("transport failed" in w for w in warnings), warnings
            assert any("update_timeout" in w for w in updater_warnings(caplog)), warnings
        finally:
            for timer in timers:
                timer.cancel()
            with_resumed(proc)
        wait_until(lambda: (updater(), updater.version)[1] == 2, timeout=CATCH_UP)
        assert same(policy, trained[1]) and updater.last_fetch.transport == "bulk"
        updater.client.close()


def test_watch_weights_fetches_a_version_that_outlasts_the_clients_timeout(make_server, monkeypatch):
    """The same pace for `WeightClient.watch_weights`, whose client has a 1 s timeout: it yields the version."""
    server = make_server(shm_dir=None)  # over bulk, read slowly
    connect = bulk_transport._connect
    monkeypatch.setattr(bulk_transport, "_connect", lambda *args: SlowReads(connect(*args)))
    trained = {"w": torch.arange(4 << 20, dtype=torch.float32)}
    with WeightClient(server.address) as trainer, WeightClient(server.address, timeout=1.0) as collector:
        trainer.publish(trained, model=MODEL)
        (result, spent) = timed(lambda: next(iter(collector.watch_weights(MODEL))))
        assert result.version == 1 and torch.equal(result.weights["w"], trained["w"])
        assert spent > 2.0


def test_a_refetch_after_a_changed_base_runs_as_long_as_its_bytes_keep_coming(make_server, monkeypatch, caplog):
    """A delta rebuilt on a base whose bytes changed since it was fetched is refetched whole; that
    refetch keeps the caller's `stall` (before, it ran under what was left of the deadline alone,
    so a version larger than that deadline's worth of the link never landed)."""
    server = make_server(shm_dir=None)  # over bulk, read slowly (from its first connection, which lasts)
    connect = bulk_transport._connect
    monkeypatch.setattr(bulk_transport, "_connect", lambda *args: SlowReads(connect(*args)))
    v1 = {"w": torch.arange(4 << 20, dtype=torch.float32)}
    v2 = {"w": v1["w"].clone()}
    v2["w"][:1000] += 1  # a small delta
    with WeightClient(server.address) as trainer, WeightClient(server.address) as collector:
        trainer.publish(v1, model=MODEL)
        base = collector.fetch(MODEL, transport="bulk")
        trainer.publish(v2, model=MODEL)
        base.tensors["w"][-1] = -1.0  # the base's bytes no longer match what was fetched
        with caplog.at_level(logging.INFO):
            result, spent = timed(lambda: collector.fetch(MODEL, base=base, transport="bulk", timeout=1.5, stall=1.5))
        assert any("fetching whole" in r.getMessage() for r in caplog.records), "no refetch happened"
        assert result.version == 2 and torch.equal(result.weights["w"], v2["w"])
        assert spent > 1.5  # the whole 16 MiB at 1 MiB per 0.15 s outlasted the deadline, and landed


def test_a_bulk_upload_cut_by_the_publishs_timeout_is_the_servers_outage_not_bulks(proc, monkeypatch, caplog):
    """The server stops as a 64 MiB publish starts over bulk: the send that fills the socket's
    buffers waits at most what is left of the publish's timeout, and the publish raises
    DeadlineExceeded without putting bulk to rest. Before, that wait's socket timeout was taken for
    bulk's failure: "bulk transport failed (... timed out); using the next one for 60s", and the
    next publishes went over the stream."""
    timers: list[threading.Timer] = []

    class StopAtTheTicket:
        def __init__(self, conn) -> None:
            self._conn = conn

        def __getattr__(self, name: str):
            return getattr(self._conn, name)

        def sendall(self, data) -> None:
            if not timers:
                timers.append(stop(proc))
            self._conn.sendall(data)

    connect = bulk_transport._connect
    monkeypatch.setattr(bulk_transport, "_connect", lambda *args: StopAtTheTicket(connect(*args)))
    weights = {"w": torch.ones(16 << 20)}  # 64 MiB: more than the sockets' buffers hold
    with WeightClient(proc.address) as trainer:
        try:
            with caplog.at_level(logging.WARNING), pytest.raises(DeadlineExceeded):
                trainer.publish(weights, model=MODEL, transport="bulk", timeout=UPDATE_TIMEOUT)
            assert timers, "the upload never started"
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert not any("transport failed" in w for w in warnings), warnings
            assert trainer.transports.usable("bulk") is not False
        finally:
            for timer in timers:
                timer.cancel()
            with_resumed(proc)
