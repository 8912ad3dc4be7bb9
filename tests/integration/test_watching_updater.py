"""GrpcLocalWeightUpdater(watch=True): no call to the server per update while its Watch
stream announces nothing newer. Real servers and gRPC; the servers count the Negotiate calls
they answer (the call a collector's update makes)."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable

import pytest
import torch
from waiting import wait_until

from weightclient import WeightClient
from weightclient.core.version_follower import VersionFollower
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightserver.service.servicer import WeightServicer
from weightserver.v1 import weights_pb2 as pb

MODEL = "policy"


def make_policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    theirs = b.state_dict()
    return all(torch.equal(t, theirs[name]) for name, t in a.state_dict().items())


def announced(updater: GrpcLocalWeightUpdater, version: int) -> Callable[[], bool]:
    return lambda: updater.announced == version


@pytest.fixture
def locates(monkeypatch) -> list[tuple[str, int]]:
    """Every fetch's Negotiate the servers started after this fixture answer, as (model,
    newer_than); a publisher's (DIRECTION_PUBLISH, also in the background) is not counted."""
    calls: list[tuple[str, int]] = []
    original = WeightServicer.Negotiate

    async def counted(self, request, context):
        if request.direction == pb.DIRECTION_FETCH:
            calls.append((request.fetch.model, request.fetch.newer_than))
        return await original(self, request, context)

    monkeypatch.setattr(WeightServicer, "Negotiate", counted)
    return calls


@pytest.fixture
def latest_calls(monkeypatch) -> list[str]:
    """Every GetLatest the servers started after this fixture answer (what `lag` asks)."""
    calls: list[str] = []
    original = WeightServicer.GetLatest

    async def counted(self, request, context):
        calls.append(request.model)
        return await original(self, request, context)

    monkeypatch.setattr(WeightServicer, "GetLatest", counted)
    return calls


@pytest.mark.parametrize("watch", [True, False])
def test_updates_ask_the_server_only_once_a_newer_version_was_announced(make_server, locates, latest_calls, watch):
    server = make_server()
    with WeightClient(server.address) as trainer_client, WeightClient(server.address) as own:
        trainer_client.publish(make_policy(1), model=MODEL)
        policy = make_policy(0)
        # bulk: the asking path (on the server's host "auto" reads an announced version's file with
        # no call at all, test_zero_copy_apply.py)
        updater = GrpcLocalWeightUpdater(own, policy=policy, watch=watch, watch_confirm_seconds=60, transport="bulk")
        updater()
        assert updater.version == 1 and same(policy, make_policy(1))
        updater()
        if watch:
            wait_until(announced(updater, 1))
        asked = len(locates)
        for _ in range(50):
            updater()
            assert updater.lag == 0
        assert updater.version == 1
        assert len(locates) - asked == (0 if watch else 50)
        assert len(latest_calls) == (0 if watch else 50)  # lag: the announced version, or a call

        trainer_client.publish(make_policy(2), model=MODEL)
        if watch:
            wait_until(announced(updater, 2))
        assert updater.lag == 1
        updater()
        assert updater.version == 2 and same(policy, make_policy(2))
        assert locates[-1] == (MODEL, 1)  # the update that applied v2 asked for newer than v1


def test_a_server_that_went_away_is_noticed_within_the_confirm_interval(make_server):
    server = make_server()
    with WeightClient(server.address) as trainer_client:
        trainer_client.publish(make_policy(1), model=MODEL)
    with WeightClient(server.address) as own:
        updater = GrpcLocalWeightUpdater(own, policy=make_policy(0), watch=True, watch_confirm_seconds=0.2)
        updater()
        updater()
        wait_until(announced(updater, 1))
        server.stop(grace=0)
        time.sleep(0.3)
        updater()  # the confirm interval has passed: it asks, and finds the server gone
        assert not updater.server_available and updater.version == 1


def test_versions_published_in_a_burst_apply_the_latest(server, client):
    trainer = make_policy(1)
    client.publish(trainer, model=MODEL)
    policy = make_policy(0)
    with WeightClient(server.address) as own:
        updater = GrpcLocalWeightUpdater(own, policy=policy, watch=True, watch_confirm_seconds=60)
        updater()
        updater()
        wait_until(announced(updater, 1))
        for seed in (2, 3, 4):
            client.publish(make_policy(seed), model=MODEL)
        wait_until(announced(updater, 4))
        updater()
        assert updater.version == 4 and same(policy, make_policy(4))


def test_a_pickled_updater_follows_again_where_it_is_used(server, client):
    client.publish(make_policy(1), model=MODEL)
    updater = GrpcLocalWeightUpdater(server.address, policy=make_policy(0), watch=True, watch_confirm_seconds=60)
    updater()
    updater()
    wait_until(announced(updater, 1))
    copy = pickle.loads(pickle.dumps(updater))
    assert not copy.following and copy.version == 1  # the Watch thread stayed behind
    copy()
    wait_until(announced(copy, 1))
    client.publish(make_policy(2), model=MODEL)
    wait_until(announced(copy, 2))
    copy()
    assert copy.version == 2 and same(copy.policy, make_policy(2))
    updater.client.close()
    copy.client.close()


def test_a_follower_stops_with_its_client(server, client):
    client.publish(make_policy(1), model=MODEL)
    own = WeightClient(server.address)
    follower = VersionFollower(own, MODEL, since=1)
    wait_until(lambda: follower.newest() == 1)
    own.close()
    wait_until(lambda: not follower.running())
    assert follower.newest() is None


def test_close_closes_the_client_the_updater_made_and_ends_its_watch(server, client):
    """An updater given an address makes its own client: close() closes it, and the Watch stream
    with it, so its follower thread ends at once (before, the client stayed open, its channel and
    sockets held, and the follower ran until its Watch call's 30 s renewal); a client passed in
    stays the caller's."""
    model = "closed-updater"
    client.publish(make_policy(1), model=model)
    updater = GrpcLocalWeightUpdater(server.address, model=model, policy=make_policy(0), watch=True)
    updater()
    wait_until(lambda: (updater(), updater.following)[1])
    own = updater.client
    updater.close()
    with pytest.raises(ValueError, match="closed channel"):
        own.latest(model)
    wait_until(lambda: not any(t.name == f"weightclient-follow-{model}" for t in threading.enumerate()), timeout=5)

    passed = GrpcLocalWeightUpdater(client, model=model, policy=make_policy(0))
    passed()
    passed.close()
    assert passed.version == 1 and client.latest(model).version == 1  # still open


def test_close_ends_the_watch_of_a_client_passed_in_at_once(make_server):
    """close() on an updater given a client (which stays open, the caller's) cancels its Watch call:
    within a second its follower's threads are gone and the server no longer counts the watcher.
    Before, stop() only set a flag the follower read between events: its thread and stream lived
    on until the call's 30 s renewal (and logged "resubscribing" if the server stopped meanwhile)."""
    server = make_server(metrics_port=0)
    model = "passed-in"

    def watchers() -> float | None:
        return server.metrics.registry.get_sample_value("weightserver_active_watchers", {"model": model})

    before = set(threading.enumerate())

    def followers() -> list[str]:
        prefixes = ("weightclient-follow-", "weightclient-cut-through")
        return [t.name for t in set(threading.enumerate()) - before if t.name.startswith(prefixes)]

    with WeightClient(server.address) as client:
        client.publish(make_policy(1), model=model)
        updater = GrpcLocalWeightUpdater(client, model=model, policy=make_policy(0), watch=True)
        updater()
        wait_until(lambda: (updater(), updater.following)[1])
        assert watchers() == 1 and followers()
        updater.close()
        wait_until(lambda: not followers() and watchers() == 0, timeout=2)
        assert client.latest(model).version == 1  # the caller's client is still open
