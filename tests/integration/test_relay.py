"""Relays (`weightserver serve --upstream`): real servers on loopback ports, real gRPC, real
tensors. A relay holds the primary's versions byte for byte, under the same numbers, metadata
and digests; it follows a relay too; it fetches deltas when it holds the base; it refuses
changes naming the primary; it keeps serving while its upstream is away, says so in its health
and metrics, and catches up without missing a version."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save
from waiting import sigstop, wait_equal, wait_until

from tests.integration.test_cut_through import Watcher
from tests.integration.test_full_disk import fill, tmpfs
from weightclient import (
    ModelNotFound,
    NotPrimary,
    VersionEvicted,
    VersionNotFound,
    WeightClient,
    WeightServiceClient,
)
from weightserver.metrics import ServerMetrics
from weightserver.process import ServerProcess
from weightserver.protocol.deltas import apply_delta
from weightserver.protocol.errors import ERROR_METADATA_KEY
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.version_info import IncomingEvent, VersionEvent
from weightserver.relay.relay import RELAY_HEALTH_SERVICE
from weightserver.server import SERVICE_NAME, WeightServer
from weightserver.storage.payloads import derive
from weightserver.storage.store import VersionStore
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def weights(step: int, big: int = 1024) -> dict[str, torch.Tensor]:
    """A policy whose `head` changes every step and whose `body` (`big` floats) never does."""
    generator = torch.Generator().manual_seed(0)
    return {"body": torch.randn(big, generator=generator), "head": torch.full((8,), float(step))}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (room for two 16 MiB versions), unmounted after the test."""
    with tmpfs(tmp_path, "64m") as mount_point:
        yield mount_point


@pytest.fixture
def make_relay(make_server):
    """`make_relay(upstream, **settings)`: a relay server of `upstream` (a server or an address)
    that polls it every 0.1 s."""

    def factory(upstream, **settings) -> WeightServer:
        address = upstream if isinstance(upstream, str) else upstream.address
        return make_server(upstream=address, upstream_poll_seconds=0.1, **settings)

    return factory


def held(server: WeightServer | str, model: str) -> int:
    """The newest version of `model` a server (in-process, or at an address) holds; 0 for none."""
    if isinstance(server, WeightServer):
        try:
            return server.store.latest(model).version
        except ModelNotFound:
            return 0
    with WeightServiceClient(server, retry_seconds=0) as client:
        try:
            return client.latest(model).version
        except ModelNotFound:
            return 0


def address_of(server: WeightServer | ServerProcess | str) -> str:
    return server if isinstance(server, str) else server.address


def describe(server, model: str, version: int) -> pb.VersionInfo:
    """The server's description of a version, as the proto carries it (every field)."""
    with grpc.insecure_channel(address_of(server)) as channel:
        return pb_grpc.WeightServiceStub(channel).Describe(pb.DescribeRequest(model=model, version=version), timeout=5)


def fetched(server, model: str, version: int, transport: str = "stream") -> bytes:
    with WeightServiceClient(address_of(server)) as client:
        return bytes(client.fetch_bytes(model, version=version, transport=transport).data)


def health(server, service: str) -> int:
    with grpc.insecure_channel(address_of(server)) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def sample(server: WeightServer, name: str, **labels: str) -> float | None:
    return server.metrics.registry.get_sample_value(name, labels)


def assert_same_versions(relay, primary, model: str, versions: list[int]) -> None:
    """The relay holds exactly `versions` of `model`, each described and fetched as the primary does."""
    assert [v.version for v in WeightServiceClient(address_of(relay)).list_versions(model)] == versions
    for version in versions:
        for server in (primary, relay):  # a version published with only an xxh3 gets its sha256 just after
            wait_until(lambda s=server, v=version: describe(s, model, v).sha256, timeout=10)
        assert describe(relay, model, version) == describe(primary, model, version)
        assert fetched(relay, model, version) == fetched(primary, model, version)


def test_a_relay_holds_the_primarys_versions_byte_for_byte(make_server, make_relay):
    primary = make_server()
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights(0), "policy", metadata={"step": "0"})
        trainer.publish(weights(1), "policy", version=7, metadata={"step": "1", "run": "a"})
        relay = make_relay(primary)
        wait_until(lambda: held(relay, "policy") == 7, timeout=10)
        trainer.publish(weights(2), "policy", metadata={"step": "2"})  # once the relay is following
        wait_until(lambda: held(relay, "policy") == 8, timeout=10)
    # Same numbers (7 is not renumbered 2), metadata, commit time, sizes, digests, tensor list.
    assert_same_versions(relay, primary, "policy", [1, 7, 8])
    assert describe(relay, "policy", 7).metadata == {"step": "1", "run": "a"}


def test_a_relay_of_a_relay_serves_the_primarys_versions_and_names_the_primary(make_server, make_relay):
    primary = make_server()
    middle = make_relay(primary)
    with (
        ServerProcess("--upstream", middle.address, "--upstream-poll", "0.1") as leaf,
        WeightClient(primary.address) as trainer,
    ):
        trainer.publish(weights(0), "policy")
        trainer.publish_group({"policy": weights(1), "critic": weights(1, big=16)}, metadata={"step": "1"})
        wait_until(lambda: held(leaf.address, "policy") == 2 and held(leaf.address, "critic") == 2, timeout=15)
        assert_same_versions(leaf, primary, "policy", [1, 2])
        assert_same_versions(leaf, primary, "critic", [2])
        assert describe(leaf, "critic", 2).group == ["policy", "critic"]
        # The leaf follows the middle relay, and knows the primary from it.
        with WeightClient(leaf.address) as client, pytest.raises(NotPrimary) as refused:
            client.publish(weights(9), "policy")
        assert str(refused.value).endswith(f"to the primary, {primary.address}")


def test_a_relay_fetches_a_delta_when_it_holds_the_base_and_rebuilds_the_version_exactly(make_server, make_relay):
    primary = make_server()
    relay = make_relay(primary, metrics_port=0)
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights(0, big=64 * 1024), "policy")
        whole = primary.store.get("policy", 1).byte_size
        # The relay counts what it fetched before the version becomes visible: once it holds v1,
        # the counter has it (a scrape never shows a version whose bytes are not counted yet).
        wait_until(lambda: held(relay, "policy") == 1)
        assert sample(relay, "weightserver_relay_fetch_bytes_total", model="policy", payload="whole") == whole
        trainer.publish(weights(1, big=64 * 1024), "policy")  # only `head` (32 bytes) changed
        wait_until(lambda: held(relay, "policy") == 2)
    delta = sample(relay, "weightserver_relay_fetch_bytes_total", model="policy", payload="delta")
    assert 0 < delta < 1024 < primary.store.get("policy", 2).byte_size
    assert sample(relay, "weightserver_relay_fetch_bytes_total", model="policy", payload="whole") == whole
    assert_same_versions(relay, primary, "policy", [1, 2])


def test_a_delta_that_does_not_rebuild_the_version_is_fetched_whole(make_server, make_relay):
    """The relay rebuilds a delta on its base's safetensors header: a version whose header differs
    otherwise (its __metadata__) rebuilds to the wrong bytes, which its xxh3 catches."""
    primary = make_server()
    relay = make_relay(primary, metrics_port=0)
    files = [save(weights(step, big=4096), metadata={"step": str(step)}) for step in range(3)]
    with WeightServiceClient(primary.address) as trainer:
        trainer.publish_bytes("policy", files[0])
        wait_until(lambda: held(relay, "policy") == 1, timeout=10)
        trainer.publish_bytes("policy", files[1])
        wait_until(lambda: held(relay, "policy") == 2, timeout=10)
    moved = {
        payload: sample(relay, "weightserver_relay_fetch_bytes_total", model="policy", payload=payload)
        for payload in ("whole", "delta")
    }
    # v1 whole, then v2's delta (discarded) and v2 whole; no delta was used.
    assert moved["whole"] > len(files[0]) + len(files[1])
    assert moved["delta"] == 0
    assert_same_versions(relay, primary, "policy", [1, 2])


def test_apply_delta_is_the_inverse_of_a_derived_delta():
    store = VersionStore()
    base = store.publish("m", save(weights(0)))
    target = store.publish("m", save(weights(1)))
    changed = {name for name, digest in target.tensor_xxh3.items() if base.tensor_xxh3[name] != digest}
    assert changed == {"head"}
    delta = derive(target.data, target.header, keep=lambda entry: entry.name in changed)
    layout = list(target.header.tensors)
    assert apply_delta(base.data, base.header, layout, target.byte_size, delta)[0] == bytes(target.data)
    # A target laid out otherwise cannot be rebuilt on this base.
    other = parse_header(save({"body": torch.zeros(3), "head": torch.zeros(8)}))
    assert apply_delta(base.data, base.header, list(other.tensors), target.byte_size, delta) is None
    assert apply_delta(base.data, base.header, layout, target.byte_size + 1, delta) is None


def test_changes_on_a_relay_are_refused_with_failed_precondition_naming_the_primary(make_server, make_relay):
    primary = make_server()
    relay = make_relay(primary)
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights(0), "policy")
    wait_until(lambda: held(relay, "policy") == 1, timeout=10)
    with WeightClient(relay.address) as client:
        for transport in ("auto", "stream"):  # Negotiate to publish, and the Publish stream
            with pytest.raises(NotPrimary, match=f"publish.*the primary, {primary.address}"):
                client.publish(weights(1), "policy", transport=transport)
        with pytest.raises(NotPrimary, match=primary.address):
            client.delete("policy", 1)
        with pytest.raises(NotPrimary, match=primary.address):
            client.pin("policy", 1)
    with grpc.insecure_channel(relay.address) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.WeightServiceStub(channel).PinVersion(pb.PinVersionRequest(model="policy", version=1), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (ERROR_METADATA_KEY, "NotPrimary") in tuple(refused.value.trailing_metadata())
    assert_same_versions(relay, primary, "policy", [1])  # nothing changed


def test_a_relay_follows_new_models_or_only_those_named(make_server, make_relay):
    primary = make_server()
    every = make_relay(primary)
    only = make_relay(primary, upstream_models=("policy",))
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights(0), "policy")
        trainer.publish(weights(0), "critic")  # a model that appears after the relays started
    wait_until(lambda: held(every, "critic") == 1 and held(only, "policy") == 1, timeout=10)
    assert every.relay.followed == ["critic", "policy"]
    assert only.relay.followed == ["policy"]
    assert [m.model for m in WeightServiceClient(only.address).list_models()] == ["policy"]


def test_a_group_publish_becomes_visible_on_a_relay_all_at_once(make_server, make_relay):
    primary = make_server()
    relay = make_relay(primary)
    seen = []  # (model committed, its version, the other model's newest version at that moment)
    relay.store.subscribe(
        lambda commit: seen.extend(
            (r.model, r.version, held(relay, "critic" if r.model == "policy" else "policy")) for r in commit.versions
        )
    )
    with WeightClient(primary.address) as trainer:
        for step in range(1, 4):
            trainer.publish_group({"policy": weights(step), "critic": weights(step, big=16)})
    wait_until(lambda: held(relay, "policy") == 3 and held(relay, "critic") == 3, timeout=10)
    assert sorted(seen) == sorted((model, v, v) for model in ("policy", "critic") for v in (1, 2, 3))
    assert_same_versions(relay, primary, "critic", [1, 2, 3])


def test_groups_published_under_one_number_are_each_committed_on_a_relay(make_server, make_relay):
    """Version numbers are per model, so groups of different models can share one: here 16 groups of
    2 models, each group at v1. A relay kept its pending group commits by number alone: a follower
    of one group's model joined another group's commit, and its v1 was never committed there (a
    silent gap), while its partner waited 60 s and was committed alone."""
    primary = make_server()
    groups = [(f"a{i}", f"b{i}") for i in range(16)]  # a relay follows the a's first: they interleave
    with WeightClient(primary.address) as trainer:
        for a, b in groups:
            assert trainer.publish_group({a: weights(1), b: weights(1, big=16)}) == 1
    relay = make_relay(primary)
    models = [model for group in groups for model in group]
    wait_until(lambda: all(held(relay, model) == 1 for model in models), timeout=30)  # (the old wait: 60 s)
    for model in models:
        assert_same_versions(relay, primary, model, [1])


def test_a_relay_keeps_serving_while_its_upstream_is_away_and_catches_up(make_relay, tmp_path):
    primary = ServerProcess("--data-dir", str(tmp_path / "primary"), "--keep", "10").start()
    try:
        relay = make_relay(primary.address, keep=10, metrics_port=0)
        with WeightClient(primary.address) as trainer:
            trainer.publish(weights(1), "policy")
            trainer.publish(weights(2), "policy")
        wait_until(lambda: held(relay, "policy") == 2, timeout=10)
        wait_until(lambda: health(relay, RELAY_HEALTH_SERVICE) == SERVING, timeout=10)
        assert sample(relay, "weightserver_relay_upstream_up") == 1
        assert sample(relay, "weightserver_relay_upstream_latest_version", model="policy") == 2
        before = {v: fetched(relay, "policy", v) for v in (1, 2)}

        primary.stop()
        wait_until(lambda: health(relay, RELAY_HEALTH_SERVICE) == NOT_SERVING, timeout=10)
        assert sample(relay, "weightserver_relay_upstream_up") == 0
        assert health(relay, "") == health(relay, SERVICE_NAME) == SERVING
        with WeightClient(relay.address) as collector:  # still served, on every transport
            for transport in ("shm", "bulk", "stream"):
                result = collector.fetch("policy", transport=transport)
                assert result.version == 2 and torch.equal(result.state_dict()["head"], weights(2)["head"])
        assert {v: fetched(relay, "policy", v) for v in (1, 2)} == before

        # Versions 3 and 4 are committed while the relay cannot see the primary (on its data dir,
        # at an address the relay does not know): only the Watch's replay can bring them.
        with ServerProcess(*primary.args) as elsewhere, WeightClient(elsewhere.address) as trainer:
            trainer.publish(weights(3), "policy")
            trainer.publish(weights(4), "policy")
        primary.start()  # same port and data dir
        wait_until(lambda: held(relay, "policy") == 4, timeout=15)
        with WeightClient(primary.address) as trainer:
            trainer.publish(weights(5), "policy")
        wait_until(lambda: held(relay, "policy") == 5, timeout=15)
        assert_same_versions(relay, primary, "policy", [1, 2, 3, 4, 5])  # none missed
        wait_until(lambda: health(relay, RELAY_HEALTH_SERVICE) == SERVING, timeout=10)
        assert sample(relay, "weightserver_relay_upstream_up") == 1
    finally:
        primary.stop()


def test_a_relay_that_never_reached_its_upstream_serves_and_says_so(make_relay, make_server):
    unused = make_server()
    address = unused.address
    unused.stop(grace=0)
    relay = make_relay(address, metrics_port=0)
    wait_until(lambda: relay.relay.upstream_up is False, timeout=10)
    assert health(relay, RELAY_HEALTH_SERVICE) == NOT_SERVING
    assert health(relay, "") == SERVING
    assert sample(relay, "weightserver_relay_upstream_up") == 0
    assert WeightServiceClient(relay.address).list_models() == []


def test_a_collector_on_a_relay_fetches_and_watches_the_primarys_weights(make_server, make_relay):
    primary = make_server()
    relay = make_relay(primary)
    with WeightClient(primary.address) as trainer, WeightClient(relay.address, client_id="collector-1") as collector:
        trainer.publish(weights(1), "policy")
        wait_until(lambda: held(relay, "policy") == 1, timeout=10)
        for transport in ("auto", "shm", "bulk", "stream"):
            result = collector.fetch("policy", transport=transport)
            assert result.version == 1
            assert all(torch.equal(result.state_dict()[k], v) for k, v in weights(1).items())
        events = collector.watch("policy", since=1, timeout=10)
        trainer.publish(weights(2), "policy")
        assert next(events).info.version == 2  # announced only once the relay holds it
        result = collector.fetch("policy", base=result)
        assert result.version == 2 and torch.equal(result.state_dict()["head"], weights(2)["head"])
        events.close()


def test_relay_metrics_measure_client_lag_against_the_upstream():
    metrics = ServerMetrics(relay=True)
    store = VersionStore()
    metrics.retained("policy", [store.publish("policy", save(weights(1)))])
    metrics.fetched("policy", 1, 100, 0.01, transport="stream", client_id="collector-1")
    metrics.upstream_latest("policy", 3)  # the relay has not fetched v2 and v3 yet
    assert (
        metrics.registry.get_sample_value(
            "weightserver_client_version_lag", {"client_id": "collector-1", "model": "policy"}
        )
        == 2
    )
    assert metrics.registry.get_sample_value("weightserver_relay_upstream_latest_version", {"model": "policy"}) == 3
    assert ServerMetrics().registry.get_sample_value("weightserver_relay_upstream_up") is None  # primaries: none


def test_serve_help_describes_relay_mode_and_models_need_an_upstream():
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "weightserver", "serve", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    shown = serve("--help").stdout
    assert "--upstream ADDRESS" in shown and "--models A,B" in shown and "--upstream-poll SECONDS" in shown
    refused = serve("--port", "0", "--models", "policy")
    assert refused.returncode == 1 and "--upstream" in refused.stderr


def retained(server, model: str) -> list[int]:
    """The versions of `model` a server (in-process, a process or an address) lists; [] for none."""
    with WeightServiceClient(address_of(server), retry_seconds=0) as client:
        try:
            return [v.version for v in client.list_versions(model)]
        except ModelNotFound:
            return []


def test_a_relay_that_misses_versions_flags_the_gap_to_its_watchers(make_server, make_relay):
    """Issue 29, item 5. A relay that misses versions of its upstream (evicted there before it
    fetched them) flags the gap on its watchers' next event, live or replayed from `since`, and
    so does a relay of that relay: the primary's rule, at every level."""
    primary = make_server(keep=2)
    files = [save(weights(step)) for step in range(61)]
    with (
        ServerProcess("--upstream", primary.address, "--upstream-poll", "0.1") as relay,
        WeightServiceClient(primary.address) as trainer,
        grpc.insecure_channel(relay.address) as channel,
    ):
        trainer.publish_bytes("policy", files[1])
        wait_until(lambda: held(relay.address, "policy") == 1, what="the relay holds v1")
        leaf = make_relay(relay.address)
        wait_until(lambda: held(leaf, "policy") == 1, what="the relay of the relay holds v1")
        live = pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model="policy", since=1), timeout=60)
        live.initial_metadata()  # sent once the relay has taken the subscription
        # The relay is stopped while 59 versions are published from 3 threads: the primary
        # keeps 2 of them, so the relay never gets v2..v58.
        sigstop(relay.process.pid)
        try:
            numbers = iter(range(2, 61))
            lock = threading.Lock()

            def publish() -> None:
                with WeightServiceClient(primary.address) as client:
                    while True:
                        with lock:
                            step = next(numbers, None)
                        if step is None:
                            return
                        client.publish_bytes("policy", files[step])

            threads = [threading.Thread(target=publish) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            os.kill(relay.process.pid, signal.SIGCONT)
        assert retained(primary, "policy") == [59, 60]
        seen = []
        for event in live:
            seen.append((event.version.version, event.gap))
            if event.version.version == 60:
                break
        live.cancel()
        # Live: the first event after v1 says that versions were missed.
        assert seen == [(59, True), (60, False)]
        # Replayed from since=1, on the relay and on the relay of the relay.
        wait_until(lambda: held(leaf, "policy") == 60, what="the relay of the relay holds v60")
        for server in (relay, leaf):
            assert first_event(server, since=1) == (59, True), address_of(server)
            # A watcher that saw v59 missed nothing before v60.
            assert first_event(server, since=59) == (60, False), address_of(server)


def first_event(server, since: int) -> tuple[int, bool]:
    """(version, gap) of the first event a Watch of "policy" from `since` gets on `server`."""
    with grpc.insecure_channel(address_of(server)) as channel:
        replay = pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model="policy", since=since), timeout=30)
        first = next(replay)
        replay.cancel()
    return first.version.version, first.gap


def test_a_gap_flagged_upstream_makes_no_later_jump_in_the_numbers_a_gap(make_server, make_relay):
    """A gap its upstream flags (here on the relay's first event: v1 was evicted) covers the
    numbers before that event only; a later version published under a higher number (v10 after
    v3) is no gap on the relay. Before, the flag stuck for the rest of the Watch, so the relay
    recorded v9 as missed and its watchers saw v10 flagged as a gap that never was."""
    primary = make_server(keep=2)
    with WeightServiceClient(primary.address) as trainer:
        for step in (1, 2, 3):
            trainer.publish_bytes("policy", save(weights(step)))
        relay = make_relay(primary)
        wait_until(lambda: held(relay, "policy") == 3, what="the relay holds v3")
        assert first_event(relay, since=0) == (2, True)  # v1 went before the relay fetched it
        trainer.publish_bytes("policy", save(weights(10)), version=10)
        wait_until(lambda: held(relay, "policy") == 10, what="the relay holds v10")
    assert first_event(primary, since=3) == (10, False)
    assert first_event(relay, since=3) == (10, False)


def test_a_relay_fetches_no_byte_of_a_version_over_its_max_model_bytes(make_server, make_relay):
    """A version over the relay's --max-model-bytes is missed there (its watchers see the gap)
    without a byte of it fetched: neither received as it arrives upstream nor fetched after its
    commit. Before, the relay received all of it as it arrived, fetched it whole again after the
    commit refused it, and only then let it go: twice the bytes it could never hold, in memory."""
    primary = make_server(metrics_port=0)
    relay = make_relay(primary, max_model_bytes=1 << 20)

    def served() -> float:
        transports = ("stream", "bulk", "shm")
        samples = (sample(primary, "weightserver_fetch_bytes_total", model="policy", transport=t) for t in transports)
        return sum(value or 0.0 for value in samples)

    with WeightClient(primary.address) as trainer, WeightClient(relay.address) as collector:
        trainer.publish(weights(1), "policy", transport="stream")
        wait_until(lambda: held(relay, "policy") == 1, what="the relay holds v1")
        watcher, before = Watcher.subscribed(collector, held=1), served()
        trainer.publish(weights(2, big=4 << 20), "policy", transport="stream")  # 16 MiB
        trainer.publish(weights(3), "policy", transport="stream")
        events = [watcher.next()]
        while not isinstance(events[-1], VersionEvent):
            events.append(watcher.next())
    assert events[-1].version == 3 and events[-1].gap  # v2 missed
    assert not [e for e in events if isinstance(e, IncomingEvent) and e.byte_size > 1 << 20]
    assert served() - before < 1 << 20


def test_a_relay_that_cannot_commit_a_version_backs_off_and_warns_once(make_server, make_relay, small_disk, caplog):
    """A relay whose commits fail (its data dir is full) retries with a growing backoff and warns
    once while the failure repeats. Before, each retry subscribed anew, and a subscription reset
    both: the relay fetched the version again every 0.1 s for as long as the disk stayed full,
    with a warning each time."""
    caplog.set_level(logging.DEBUG, logger="weightserver.relay.relay")
    primary = make_server()
    relay = make_relay(primary, data_dir=small_disk / "relay")

    def failures() -> list[logging.LogRecord]:
        return [record for record in caplog.records if "StorageFull" in record.getMessage()]

    with WeightClient(primary.address) as trainer:
        trainer.publish(weights(1, big=1 << 20), "policy")  # 4 MiB
        wait_until(lambda: held(relay, "policy") == 1, what="the relay holds v1")
        fill(small_disk, leave=0)
        trainer.publish(weights(2, big=1 << 20), "policy")
        wait_until(lambda: len(failures()) >= 5, timeout=30, what="five failed commits")
    first, *repeats = failures()
    assert first.levelno == logging.WARNING and {record.levelno for record in repeats} == {logging.DEBUG}
    assert repeats[3].created - repeats[2].created >= 0.4  # the backoff after the fourth: 0.8 s +- 50%


def test_deletes_on_the_primary_reach_every_relay_within_a_poll(make_server, make_relay, tmp_path):
    """Issue 29, item 6. A version deleted on the primary, one or all of a model's, leaves
    every relay within its poll interval: a relay, a relay of that relay, and a relay process
    that was down during the delete and comes back on its data dir (it checks what it holds at
    start). A relay started afterwards holds none, and all of them follow the next version."""
    primary = make_server()
    first = make_relay(primary)
    second = make_relay(first)
    restarted = ServerProcess(
        "--upstream", primary.address, "--upstream-poll", "0.1", "--data-dir", str(tmp_path / "relay")
    )
    with restarted, WeightServiceClient(primary.address) as admin:
        for step in (1, 2, 3):
            admin.publish_bytes("policy", save(weights(step)))
        relays = (first, second, restarted)
        for relay in relays:
            wait_equal(lambda relay=relay: retained(relay, "policy"), [1, 2, 3], what=f"{address_of(relay)} holds 1-3")

        admin.delete("policy", 2)
        for relay in relays:
            wait_equal(lambda relay=relay: retained(relay, "policy"), [1, 3], what=f"{address_of(relay)} drops v2")
        with pytest.raises(VersionNotFound, match="deleted"):
            fetched(second, "policy", 2)

        restarted.stop()
        admin.delete("policy", 1)
        admin.delete("policy", 3)
        for relay in (first, second):
            wait_equal(lambda relay=relay: retained(relay, "policy"), [], what=f"{address_of(relay)} drops v1, v3")
        restarted.start()  # on its data dir, which holds v1 and v3
        wait_equal(lambda: retained(restarted, "policy"), [], what="the restarted relay drops v1, v3")
        late = make_relay(primary)
        assert retained(late, "policy") == []

        admin.publish_bytes("policy", save(weights(4)))
        for relay in (*relays, late):
            wait_equal(lambda relay=relay: retained(relay, "policy"), [4], what=f"{address_of(relay)} holds v4")
        assert_same_versions(second, primary, "policy", [4])


def test_a_relay_holds_no_version_its_upstream_evicted(make_server, make_relay):
    """A relay serves what its upstream retains, within its own --keep: a version evicted
    upstream goes from the relay too (a relay with a larger --keep does not keep more), and
    asking for it there says it was evicted, not deleted."""
    primary = make_server(keep=2)
    relay = make_relay(primary, keep=5)
    with WeightServiceClient(primary.address) as trainer:
        for step in (1, 2, 3, 4):
            trainer.publish_bytes("policy", save(weights(step)))
            wait_until(lambda step=step: held(relay, "policy") == step, what=f"the relay holds v{step}")
    wait_equal(lambda: retained(relay, "policy"), [3, 4], what="the relay keeps what the primary keeps")
    with pytest.raises(VersionEvicted):
        fetched(relay, "policy", 1)


@pytest.mark.parametrize(("primary_settings", "transport"), [({}, "shm"), ({"shm_dir": None}, "bulk")])
def test_a_relay_follows_over_shared_memory_on_the_same_host_else_bulk(
    make_server, make_relay, primary_settings, transport
):
    """Issue 28: a relay is a client of its upstream, so it negotiates the fastest transport a
    collector would: the primary's shared memory on the same host, else bulk TCP, not the stream."""
    primary = make_server(metrics_port=0, **primary_settings)
    relay = make_relay(primary, metrics_port=0)
    with WeightClient(primary.address) as trainer:
        trainer.publish(weights(1, big=64 * 1024), "policy")
        wait_until(lambda: held(relay, "policy") == 1, timeout=10)
    whole = primary.store.get("policy", 1).byte_size
    moved = {
        name: sample(primary, "weightserver_fetch_bytes_total", model="policy", transport=name) or 0
        for name in ("shm", "bulk", "stream")
    }
    assert moved == {name: whole if name == transport else 0 for name in moved}
    assert sample(relay, "weightserver_relay_fetch_bytes_total", model="policy", payload="whole") == whole
    assert_same_versions(relay, primary, "policy", [1])
