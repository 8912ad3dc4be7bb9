"""Cut-through in relays (issue 16): a relay receives a publish's bytes while they arrive at
its upstream and passes them on to its own followers as they land, so that a follower two
levels down is receiving before the primary has committed; it commits them only once the
upstream's commit names them and they match. A publish cut half-way is never visible at any
depth."""

from __future__ import annotations

import pytest
from waiting import wait_until

from tests.integration import test_relay
from tests.integration.test_cut_through import EarlyReceive, HeldPublish, Watcher, file_of, weights_filled
from tests.integration.test_full_disk import fill
from tests.integration.test_relay import assert_same_versions, held
from weightclient import WeightClient
from weightserver.process import ServerProcess
from weightserver.protocol.version_info import IncomingEvent, VersionEvent

MODEL = "policy"
small_disk = test_relay.small_disk  # a fixture


@pytest.fixture
def tree(make_server):
    """A primary holding v1, a relay of it and a relay of that relay, both holding v1."""
    primary = make_server()
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights_filled(0.0), model=MODEL, transport="stream")
    middle = make_server(upstream=primary.address, upstream_poll_seconds=0.1)
    leaf = make_server(upstream=middle.address, upstream_poll_seconds=0.1)
    wait_until(lambda: held(leaf, MODEL) == 1, timeout=15)
    return primary, middle, leaf


@pytest.mark.parametrize("publish_over", ["bulk", "stream"])
def test_a_follower_two_relays_down_receives_a_publish_before_the_primary_commits_it(tree, publish_over):
    primary, _, leaf = tree
    with WeightClient(leaf.address) as collector:
        watcher = Watcher.subscribed(collector, held=1)
        data = file_of(weights_filled(2.5))
        publish = HeldPublish(primary.address, data, publish_over)  # half its bytes, then it waits
        announced = watcher.next()
        assert isinstance(announced, IncomingEvent) and announced.byte_size == len(data)
        receive = EarlyReceive(collector, announced, "bulk")
        # Bytes reach the leaf's follower through two relays while the primary has committed nothing.
        wait_until(lambda: receive.received >= 1 << 20, timeout=10)
        assert receive.received < len(data) and held(primary, MODEL) == 1
        version = publish.finish()
        committed = watcher.next()
        assert isinstance(committed, VersionEvent) and committed.version == version
        assert committed.incoming == announced.id  # the leaf's commit names the bytes it passed on
        early = receive.join()
        assert not isinstance(early, Exception), early
        assert bytes(early.data) == data
    wait_until(lambda: held(leaf, MODEL) == version, timeout=10)
    assert_same_versions(leaf, primary, MODEL, [1, version])


@pytest.mark.parametrize("publish_over", ["bulk", "stream"])
def test_a_publish_cut_half_way_is_never_visible_at_any_depth(tree, publish_over):
    primary, middle, leaf = tree
    with WeightClient(leaf.address) as collector:
        watcher = Watcher.subscribed(collector, held=1)
        publish = HeldPublish(primary.address, file_of(weights_filled(3.5)), publish_over)
        announced = watcher.next()
        assert isinstance(announced, IncomingEvent)
        receive = EarlyReceive(collector, announced, "bulk")
        wait_until(lambda: receive.received >= 1 << 20, timeout=10)
        publish.cut()
        failed = watcher.next()
        assert isinstance(failed, IncomingEvent) and failed.id == announced.id and failed.failed
        assert not isinstance(receive.join(), bytes)
        # The next good publish still flows through the tree, and nothing of the cut one exists.
        with WeightClient(primary.address) as trainer:
            version = trainer.publish(weights_filled(4.5), model=MODEL, transport=publish_over)
        assert version == 2
        wait_until(lambda: held(leaf, MODEL) == 2, timeout=10)
    for server in (primary, middle, leaf):
        assert [v.version for v in WeightClient(server.address).list_versions(MODEL)] == [1, 2]
    assert_same_versions(leaf, primary, MODEL, [1, 2])


def test_bytes_received_early_that_a_full_disk_cannot_commit_are_announced_failed(make_server, small_disk):
    """A relay whose data dir is full cannot commit a publish it received as it arrived: its
    watchers are told that those bytes failed (and the buffer is let go), and once there is room
    the version comes. Before, the commit's StorageFull left the relay's incoming publish open
    for good: its watchers waited for an end that never came, and the relay held the buffer."""
    primary = make_server()
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights_filled(0.0), model=MODEL, transport="stream")
    relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1, data_dir=small_disk / "relay")
    wait_until(lambda: held(relay, MODEL) == 1, timeout=15)
    fill(small_disk, leave=0)
    with WeightClient(relay.address) as collector:
        watcher = Watcher.subscribed(collector, held=1)
        publish = HeldPublish(primary.address, file_of(weights_filled(2.5)), "stream")
        announced = watcher.next()
        assert isinstance(announced, IncomingEvent) and not announced.failed
        assert publish.finish() == 2
        failed = watcher.next()
        assert isinstance(failed, IncomingEvent) and failed.id == announced.id and failed.failed
        (small_disk / "filler").unlink()
        committed = watcher.next()
        assert isinstance(committed, VersionEvent) and committed.version == 2
    assert_same_versions(relay, primary, MODEL, [1, 2])


def test_a_relay_lets_go_of_bytes_it_was_receiving_from_an_upstream_that_died(make_server):
    """An upstream that dies during a publish sends no `failed` event and no commit: the relay's
    receive of the bytes fails, its watchers are told, and the relay lets go of the buffer.
    Before, the relay kept it (landed bytes in memory: up to the model's size) until eight more
    publishes were announced and never committed, which in practice is never."""
    with ServerProcess() as primary:
        with WeightClient(primary.address) as trainer:
            trainer.publish(weights_filled(0.0), model=MODEL, transport="stream")
        relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1)
        wait_until(lambda: held(relay, MODEL) == 1, timeout=15)
        with WeightClient(relay.address) as collector:
            watcher = Watcher.subscribed(collector, held=1)
            publish = HeldPublish(primary.address, file_of(weights_filled(2.5)), "stream")
            announced = watcher.next()
            assert isinstance(announced, IncomingEvent) and not announced.failed
            assert relay.relay.receiving == 1
            primary.kill()
            failed = watcher.next()
            assert isinstance(failed, IncomingEvent) and failed.id == announced.id and failed.failed
            publish.cut()
    assert relay.relay.receiving == 0
