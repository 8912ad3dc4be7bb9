"""Client failover (issue 16): a client given several addresses ("relay,primary") moves to the
next when its server is down or stalled, and never applies an older version than it holds.
Real servers: a primary and a relay of it in this process, stopped servers in subprocesses; a
relay SIGKILLed while it streams a committed version, and while it passes on a publish's bytes
before their commit (cut-through)."""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from waiting import wait_until

from tests.integration.test_cut_through import SIZE, EarlyReceive, HeldPublish, Watcher, file_of, weights_filled
from tests.integration.test_relay import held
from tests.integration.test_stalled_server import stopped
from weightclient import DeadlineExceeded, WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightserver.process import ServerProcess
from weightserver.protocol.version_info import IncomingEvent

MODEL = "policy"


def linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8)


def holds(policy: torch.nn.Module, weights: torch.nn.Module) -> bool:
    return all(
        torch.equal(a, b) for a, b in zip(policy.state_dict().values(), weights.state_dict().values(), strict=True)
    )


def test_a_client_moves_to_the_next_address_when_its_server_is_down(make_server):
    primary = make_server()
    relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1)
    with WeightClient(primary.address) as trainer, WeightClient(f"{relay.address},{primary.address}") as client:
        trainer.publish(linear(1), model=MODEL)
        wait_until(lambda: held(relay, MODEL) == 1, timeout=15)
        assert client.fetch(MODEL).version == 1 and client.address == relay.address
        relay.stop(grace=0)
        trainer.publish(linear(2), model=MODEL)
        result = client.fetch(MODEL, transport="bulk", timeout=20)
        assert result.version == 2 and client.address == primary.address
        assert client.addresses == [relay.address, primary.address]
        assert [event.version for event in _first_events(client, since=0, count=2)] == [1, 2]


def _first_events(client: WeightClient, since: int, count: int) -> list:
    events = []
    for event in client.watch(MODEL, since=since, timeout=10):
        events.append(event)
        if len(events) == count:
            break
    return events


def test_a_watch_outlives_the_link_it_started_on(caplog):
    """A fetch that fails over moves the client on and keeps the link it left open for calls still
    running on it, closing it only a few moves later (RETIRED_LINKS). A watch still streaming from
    that server then ended with Cancelled ("Channel closed!"), as if its caller had cancelled it (a
    follower took that for a closed client and stopped following); now it resubscribes, from the
    last version seen, at the server in use. The moves are real: the server in use stalls (SIGSTOP)
    under a call, in turn, until the client has moved three times."""
    primary = ServerProcess()
    primary.start()
    relay = ServerProcess("--upstream", primary.address, "--upstream-poll", "0.1")
    relay.start()
    servers = {server.address: server for server in (primary, relay)}
    caplog.set_level(logging.WARNING, logger="weightclient")
    try:
        with WeightClient(primary.address) as trainer, WeightClient(f"{relay.address},{primary.address}") as client:
            trainer.publish(linear(1), model=MODEL)
            wait_until(lambda: held(relay.address, MODEL) == 1, timeout=15)
            events = client.watch(MODEL, since=0, timeout=20)
            assert next(events).version == 1  # streaming from the relay
            while sum("moving to" in record.getMessage() for record in caplog.records) < 3:
                with stopped(servers[client.address]), contextlib.suppress(DeadlineExceeded):
                    client.latest(MODEL, retry=False, timeout=1.0)  # half of it on the stalled server, then the next
            trainer.publish(linear(2), model=MODEL)
            assert next(events).version == 2
            events.close()
    finally:
        relay.kill()
        primary.kill()


def test_a_watching_updater_follows_on_through_the_next_address(make_server):
    primary = make_server()
    relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1)
    policy = torch.nn.Linear(8, 8)
    with WeightClient(primary.address) as trainer, WeightClient(f"{relay.address},{primary.address}") as client:
        trainer.publish(linear(1), model=MODEL)
        updater = GrpcLocalWeightUpdater(client, model=MODEL, policy=policy, watch=True, update_timeout=2.0)
        wait_until(lambda: (updater(), updater.version == 1)[1], timeout=15)
        relay.stop(grace=0)
        weights = linear(2)
        trainer.publish(weights, model=MODEL)
        wait_until(lambda: (updater(), updater.version == 2)[1], timeout=30)
        assert holds(policy, weights) and client.address == primary.address
        updater.close()


def test_a_stalled_server_is_left_for_the_next_and_an_older_version_is_never_applied(make_server, tmp_path):
    """The first server holds v3 and stalls (SIGSTOP: its port accepts, nothing answers); the
    next holds only v1: the updater keeps v3, asks the next one, and applies nothing older."""
    ahead = ServerProcess("--data-dir", str(tmp_path / "ahead"))
    ahead.start()
    behind = make_server()
    policy = torch.nn.Linear(8, 8)
    try:
        with WeightClient(ahead.address) as trainer, WeightClient(behind.address) as other:
            for seed in (1, 2, 3):
                trainer.publish(linear(seed), model=MODEL)
            other.publish(linear(9), model=MODEL)
        with WeightClient(f"{ahead.address},{behind.address}") as client:
            updater = GrpcLocalWeightUpdater(client, model=MODEL, policy=policy, update_timeout=1.0)
            updater()
            assert updater.version == 3 and holds(policy, linear(3))
            with stopped(ahead):
                for _ in range(5):
                    updater()
                assert client.address == behind.address  # it moved on
                assert updater.version == 3 and holds(policy, linear(3))  # and went back to nothing
                assert updater.lag == 0 and updater.server_available
    finally:
        ahead.kill()


def test_a_relay_killed_mid_transfer_leaves_the_fetch_to_the_primary_whole(make_server):
    """SIGKILL the relay while it streams a version to a collector: the fetch moves on to the
    primary and returns the version whole and verified, nothing torn."""
    primary = make_server()
    weights = {"w": torch.randn(8 << 20)}  # 32 MiB: many chunks
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights, model=MODEL)
    relay = ServerProcess("--upstream", primary.address, "--upstream-poll", "0.1")
    relay.start()
    try:
        wait_until(lambda: held(relay.address, MODEL) == 1, timeout=15)
        killed = []

        def kill_half_way(received: int, total: int) -> None:
            if received > total // 2 and not killed:
                relay.kill()
                killed.append(received)

        with WeightClient(f"{relay.address},{primary.address}") as client:
            fetched = client.fetch_bytes(MODEL, version=1, transport="stream", progress=kill_half_way, timeout=30)
            assert killed and client.address == primary.address
            result = client.fetch(MODEL, version=1, transport="stream")
        assert fetched is not None and fetched.info.version == 1
        assert torch.equal(result.state_dict()["w"], weights["w"])
        assert fetched.data.nbytes == result.data.nbytes and bytes(fetched.data) == bytes(result.data)
    finally:
        relay.kill()


class Flat(torch.nn.Module):
    """A policy shaped like `weights_filled`'s file: `w` (16 MiB of float32) and `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SIZE))
        self.register_buffer("b", torch.zeros(5, dtype=torch.int64))


def test_a_relay_killed_during_a_followers_early_receive_leaves_the_version_to_the_primary_whole(make_server):
    """SIGKILL the relay while a watching updater (cut-through) receives a publish's bytes from
    it before the primary commits them (the trainer holds the publish half-way): the updater
    keeps the version it holds, never a torn or older one; once the publish commits it applies
    that version whole and verified, from the primary."""
    primary = make_server()
    first, published = weights_filled(0.5), weights_filled(2.5)
    with WeightClient(primary.address) as trainer:
        trainer.publish(first, model=MODEL, transport="stream")
    relay = ServerProcess("--upstream", primary.address, "--upstream-poll", "0.1").start()
    policy = Flat()
    applied: list[int] = []
    updater: GrpcLocalWeightUpdater | None = None

    def update() -> None:
        """One update; the policy then holds exactly the version applied (never a mix), never an older one."""
        updater()
        applied.append(updater.version)
        assert applied == sorted(applied), applied
        expected = {1: first, 2: published}[updater.version]
        assert all(torch.equal(getattr(policy, key), expected[key]) for key in ("w", "b")), updater.version

    try:
        wait_until(lambda: held(relay.address, MODEL) == 1, timeout=15)
        with (
            WeightClient(f"{relay.address},{primary.address}") as client,
            WeightClient(relay.address) as probe,
        ):
            # bulk, as a collector on another host: on the relay's host "auto" maps its files (no cut-through)
            updater = GrpcLocalWeightUpdater(
                client, model=MODEL, policy=policy, watch=True, update_timeout=2.0, transport="bulk"
            )
            wait_until(lambda: (update(), updater.announced == 1)[1])
            assert updater.incoming
            watcher = Watcher.subscribed(probe, held=1)  # a second follower of the relay, to see its bytes flow
            publish = HeldPublish(primary.address, file_of(published), "stream")  # half, then it waits
            announced = watcher.next()
            assert isinstance(announced, IncomingEvent)
            receive = EarlyReceive(probe, announced, "bulk")
            # The relay passes the first half on as it lands; the updater's follower is receiving it.
            wait_until(lambda: receive.received >= 1 << 20, timeout=10)
            wait_until(lambda: updater.receiving, timeout=10)
            assert held(primary, MODEL) == 1 and client.address == relay.address
            relay.kill()
            assert not isinstance(receive.join(), bytes)  # cut short on the relay's side
            for _ in range(10):  # the relay is gone and nothing is committed: v1 stays
                update()
                time.sleep(0.05)
            assert updater.version == 1
            version = publish.finish()
            assert version == 2
            wait_until(lambda: (update(), updater.version == 2)[1], timeout=30)
            assert client.address == primary.address
        committed = primary.store.get(MODEL, 2)
        assert updater.applied.xxh3 == committed.xxh3 and updater.applied.byte_size == committed.byte_size
        assert all(torch.equal(getattr(policy, key), published[key]) for key in ("w", "b"))
        assert set(applied) == {1, 2}
    finally:
        relay.kill()
        if updater is not None:
            updater.close()
