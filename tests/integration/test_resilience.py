"""Resilient clients: idempotent calls retry while the server restarts, watches resubscribe
from the last version seen, and a collector keeps collecting on its current weights while the
server is down, then catches up. Real server processes, stopped and restarted on the same port
and data dir."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torchrl_models import actions_of, make_policy
from waiting import wait_until

from tests.system.test_torchrl_integration import ATOL, catch_up, single_collector
from weightclient import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightclient.torchrl.scheme import GrpcWeightSyncScheme
from weightserver.process import ServerProcess
from weightserver.protocol.errors import DeadlineExceeded, ServerUnavailable

MODEL = "policy"
DOWN = (ServerUnavailable, DeadlineExceeded)


@pytest.fixture
def proc(tmp_path):
    server = ServerProcess("--data-dir", str(tmp_path / "data"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


def restart_later(server: ServerProcess, delay: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), server.start()), daemon=True)
    thread.start()
    return thread


def test_idempotent_calls_retry_through_a_restart_and_publish_does_not(proc):
    with WeightClient(proc.address) as client:
        client.publish({"w": torch.ones(8)}, model=MODEL)
        proc.kill()
        with pytest.raises(DOWN):
            client.publish({"w": torch.zeros(8)}, model=MODEL)  # never retried: it is not idempotent
        with pytest.raises(DOWN):
            client.fetch(MODEL, timeout=0.5)  # bounded by the caller's deadline
        thread = restart_later(proc, 1.0)
        assert client.latest(MODEL).version == 1  # retried until the server was back
        result = client.fetch(MODEL)
        assert torch.equal(result.tensors["w"], torch.ones(8))
        thread.join()
        proc.kill()
        thread = restart_later(proc, 1.0)
        assert client.fetch(MODEL, transport="auto").version == 1
        assert [v.version for v in client.list_versions(MODEL)] == [1]
        thread.join()


def test_watch_resubscribes_from_the_last_version_seen(proc):
    seen: list[int] = []
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            with WeightClient(proc.address) as watcher:
                for event in watcher.watch(MODEL, since=0, timeout=60):
                    seen.append(event.version)
                    if event.version >= 4:
                        return
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    with WeightClient(proc.address) as client:
        client.publish({"w": torch.ones(4)}, model=MODEL)
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        wait_until(lambda: seen == [1])
        proc.kill()
        time.sleep(1.0)  # the watcher retries meanwhile
        proc.start()
        assert client.latest(MODEL).version == 1  # retried while the channel reconnects
        for value in (2, 3, 4):
            client.publish({"w": torch.full((4,), float(value))}, model=MODEL)
        thread.join(timeout=60)
    assert not errors, errors
    assert seen == [1, 2, 3, 4]  # nothing missed, nothing repeated across the restart


def test_updater_keeps_its_weights_warns_once_and_catches_up(proc, caplog):
    trainer, policy = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with WeightClient(proc.address) as client:
        client.publish(trainer, model=MODEL)
        updater = GrpcLocalWeightUpdater(proc.address, policy=policy)
        updater()
        assert updater.version == 1 and updater.server_available
        applied = {k: v.clone() for k, v in policy.state_dict().items()}

        proc.kill()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            started = time.monotonic()
            assert updater.lag is None  # unknown, and answered at once rather than after retrying
            assert time.monotonic() - started < 10.0
            calls = 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # "batches" while the server is down
                updater()
                calls += 1
                time.sleep(0.02)
        assert calls > 20  # each update returned promptly instead of waiting for the server
        assert updater.version == 1 and not updater.server_available and updater.lag is None
        assert "unavailable" in updater.status
        assert all(torch.equal(policy.state_dict()[k], v) for k, v in applied.items())
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "keeps v1" in warnings[0].getMessage()

        proc.start()
        client.latest(MODEL)  # the trainer's channel reconnects (publish itself never retries)
        with torch.no_grad():
            trainer.weight.add_(1.0)
        client.publish(trainer, model=MODEL)
        wait_until(lambda: (updater(), updater.version)[1] == 2)
        assert updater.server_available and updater.lag == 0
        assert torch.equal(policy.weight, trainer.weight)
        updater.client.close()


def test_collector_keeps_collecting_while_the_server_is_down_and_reaches_the_latest(proc):
    """A real torchrl Collector pulling every batch: the server stops for several seconds and
    comes back on the same port and data dir; the collector never stops producing batches."""
    trained = [make_policy(seed) for seed in (1, 2, 3)]
    with WeightClient(proc.address) as client:
        client.publish(trained[0], model=MODEL)
        scheme = GrpcWeightSyncScheme(proc.address)
        collector = single_collector(make_policy(0), scheme)
        try:
            batches = iter(collector)
            collector.update_policy_weights_()
            assert scheme.version == 1

            proc.kill()
            down_batches = 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                collector.update_policy_weights_()
                batch = next(batches)
                assert torch.allclose(batch["action"], actions_of(trained[0], batch), atol=ATOL)
                down_batches += 1
            assert down_batches >= 10 and scheme.version == 1 and scheme.lag is None

            proc.start()
            client.latest(MODEL)
            client.publish(trained[1], model=MODEL)
            client.publish(trained[2], model=MODEL)
            catch_up(collector, scheme, batches, 3, trained[2])
        finally:
            collector.shutdown()
            scheme.puller.client.close()


def test_a_new_client_reaches_a_server_restarted_at_the_same_address_while_an_old_client_is_open(make_server):
    """gRPC shares connections between a process's channels by default: a new client then took
    over the old client's connection to the stopped server, in backoff, and its first call was
    refused at once. Each client's channel has connections of its own."""
    first, weights = make_server(), {"w": torch.ones(4)}
    with WeightClient(first.address) as old:
        old.publish(weights, model="m", transport="stream")
        first.stop(grace=0)
        with pytest.raises((ServerUnavailable, DeadlineExceeded)):  # its connection now backs off
            old.publish(weights, model="m", transport="stream", timeout=1)
        restarted = make_server(port=first.port)
        with WeightClient(restarted.address) as new:
            assert new.publish(weights, model="m", transport="stream") == 1


def test_a_server_that_fails_to_start_leaves_no_thread_behind(server):
    """A start that fails (here: its port is taken) lets go of what it set up. Before, the servicer
    built before the bind was never closed: each failed start left its upload sweeper running."""
    from weightserver import ServerConfig, WeightServer

    def sweepers() -> int:
        return sum(t.name == "weightserver-upload-sweeper" for t in threading.enumerate())

    before = sweepers()
    for _ in range(3):
        with pytest.raises(OSError, match="is the port in use"):
            WeightServer(ServerConfig(host="127.0.0.1", port=server.port)).start()
    wait_until(lambda: sweepers() == before, what="the failed starts' upload sweepers to end")
