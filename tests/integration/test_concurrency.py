"""Concurrent fetchers and publishers against a real server: a fetch never sees a mix of two
versions, and racing publishers never share or mix a version."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest
import torch

from weightclient import VersionConflict, WeightClient
from weightserver.storage.persistence import Disk

MODEL = "policy"
JOIN = 30.0


def version_weights(value: int, numel: int = 64 * 1024) -> dict[str, torch.Tensor]:
    """Several tensors of different dtypes, all filled with `value`."""
    return {
        "a": torch.full((numel,), float(value)),
        "b": torch.full((numel // 2,), value, dtype=torch.int64),
        "c": torch.full((numel,), float(value), dtype=torch.bfloat16),
        "d": torch.full((16,), value, dtype=torch.int16),
    }


def run_threads(targets: list[Callable[[], None]]) -> None:
    """Run `targets` in threads; re-raise the first exception any of them raised."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def test_concurrent_fetchers_never_see_a_mixed_version(server) -> None:
    last = 20
    done = threading.Event()
    with WeightClient(server.address) as publisher:
        assert publisher.publish(version_weights(1), model=MODEL, version=1, metadata={"value": "1"}) == 1

        seen: list[list[int]] = [[] for _ in range(4)]

        def fetcher(index: int) -> Callable[[], None]:
            def run() -> None:
                with WeightClient(server.address) as client:
                    while True:
                        finished = done.is_set()
                        result = client.fetch(MODEL)  # sha256 is verified by the client
                        assert result is not None
                        value = int(result.metadata["value"])
                        assert value == result.version
                        for name, tensor in result.state_dict().items():
                            assert bool((tensor == value).all()), (
                                f"fetch of version {result.version}: tensor {name!r} holds "
                                f"{tensor.unique().tolist()}, expected only {value}"
                            )
                        seen[index].append(result.version)
                        if finished:
                            return

            return run

        def publish_all() -> None:
            try:
                for version in range(2, last + 1):
                    published = publisher.publish(
                        version_weights(version), model=MODEL, version=version, metadata={"value": str(version)}
                    )
                    assert published == version
            finally:
                done.set()

        run_threads([fetcher(i) for i in range(4)] + [publish_all])

    for versions in seen:
        assert versions, "a fetcher never fetched"
        assert versions == sorted(versions), "latest went backwards"
        assert versions[-1] == last  # each fetcher's last fetch started after the last publish


def test_racing_publishers_with_auto_versions_get_distinct_versions(make_server) -> None:
    server = make_server(keep=100)
    per_publisher = 10
    start = threading.Barrier(2, timeout=JOIN)
    results: dict[int, list[int]] = {0: [], 1: []}

    def publisher(pid: int) -> Callable[[], None]:
        def run() -> None:
            with WeightClient(server.address) as client:
                start.wait()
                for i in range(per_publisher):
                    value = pid * 1000 + i
                    version = client.publish(version_weights(value, 4096), model=MODEL, metadata={"value": str(value)})
                    results[pid].append(version)

        return run

    run_threads([publisher(0), publisher(1)])

    everything = results[0] + results[1]
    assert len(set(everything)) == len(everything) == 2 * per_publisher
    assert sorted(everything) == list(range(1, 2 * per_publisher + 1))
    for pid in (0, 1):
        assert results[pid] == sorted(results[pid])  # each publisher's versions increase
    # Every stored version holds exactly what one publisher sent for it.
    with WeightClient(server.address) as client:
        for pid, versions in results.items():
            for i, version in enumerate(versions):
                result = client.fetch(MODEL, version=version)
                assert result is not None
                value = pid * 1000 + i
                assert result.metadata == {"value": str(value)}
                for tensor in result.state_dict().values():
                    assert bool((tensor == value).all())


def test_racing_publishers_on_the_same_version_one_wins(server) -> None:
    rounds = 10
    with WeightClient(server.address) as a, WeightClient(server.address) as b:
        clients = (a, b)

        def publisher(
            pid: int, version: int, start: threading.Barrier, outcome: dict[int, int | BaseException]
        ) -> Callable[[], None]:
            def run() -> None:
                value = version * 10 + pid
                start.wait()
                try:
                    outcome[pid] = clients[pid].publish(
                        version_weights(value, 16 * 1024),
                        model=MODEL,
                        version=version,
                        metadata={"value": str(value)},
                    )
                except VersionConflict as exc:
                    outcome[pid] = exc

            return run

        for version in range(1, rounds + 1):
            start = threading.Barrier(2, timeout=JOIN)
            outcome: dict[int, int | BaseException] = {}
            run_threads([publisher(0, version, start, outcome), publisher(1, version, start, outcome)])

            winners = [pid for pid, result in outcome.items() if result == version]
            losers = [pid for pid, result in outcome.items() if isinstance(result, VersionConflict)]
            assert len(winners) == 1 and len(losers) == 1, outcome
            error = outcome[losers[0]]
            assert isinstance(error, VersionConflict)
            assert isinstance(error.__context__, grpc.RpcError)
            assert error.__context__.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"requested version {version}" in str(error)

            # The stored version is the winner's, whole.
            result = a.fetch(MODEL, version=version)
            assert result is not None
            value = version * 10 + winners[0]
            assert result.metadata == {"value": str(value)}
            for tensor in result.state_dict().values():
                assert bool((tensor == value).all())
            assert a.latest(MODEL).version == version


def test_watcher_sees_every_version_when_commit_notifications_race(make_server, tmp_path, monkeypatch) -> None:
    """Two publishes of one model commit back to back; the first publisher's thread is held up
    after its commit (as by a slow unlink of the version it evicted, or the GIL) while the second
    commits and notifies. The watcher must still get both versions, in order.

    The hold-up is a slow unlink of the evicted version's files, after the commit: the commit of
    version 2 (which evicts version 1 with keep=1) waits there until version 3 has been committed.
    This failed (the watcher got only [3]) while the store called listeners after releasing the
    model's commit lock.
    """
    server = make_server(keep=1, data_dir=tmp_path / "data")
    store = server.store
    subscribed = threading.Event()
    first_held = threading.Event()
    second_committed = threading.Event()
    subscribe, remove_files = store.subscribe, Disk.remove_files

    def instrumented_subscribe(listener):
        unsubscribe = subscribe(listener)
        subscribed.set()
        return unsubscribe

    def delayed_remove_files(disk, records):
        versions = [r.version for r in records]
        if versions == [1]:  # after committing version 2
            first_held.set()
            second_committed.wait(JOIN)
        elif versions == [2]:  # after committing version 3
            second_committed.set()
        return remove_files(disk, records)

    store.subscribe = instrumented_subscribe
    monkeypatch.setattr(Disk, "remove_files", delayed_remove_files)

    with WeightClient(server.address) as a, WeightClient(server.address) as b, WeightClient(server.address) as w:
        assert a.publish({"w": torch.zeros(4)}, model=MODEL) == 1
        events = w.watch(MODEL, since=1, timeout=JOIN)
        received: list[int] = []

        def watch() -> None:
            try:
                for event in events:
                    received.append(event.version)
                    if event.version >= 3:
                        return
            finally:
                events.close()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert subscribed.wait(10)

        first_result: list[int] = []
        first = threading.Thread(target=lambda: first_result.append(a.publish({"w": torch.ones(4)}, model=MODEL)))
        first.start()
        assert first_held.wait(10)
        assert b.publish({"w": torch.full((4,), 3.0)}, model=MODEL) == 3
        first.join(JOIN)
        assert first_result == [2]
        watcher.join(JOIN)
        assert not watcher.is_alive()
    assert received == [2, 3]


@pytest.mark.parametrize("publishers", [2, 4])
def test_watcher_sees_every_version_from_racing_publishers(server, publishers: int) -> None:
    """Commits from several publishing threads reach a watcher in version order, none skipped."""
    per_publisher = 15
    total = publishers * per_publisher
    events: list[int] = []
    subscribed = threading.Event()
    subscribe = server.store.subscribe

    def instrumented(listener):
        unsubscribe = subscribe(listener)
        subscribed.set()
        return unsubscribe

    server.store.subscribe = instrumented

    with WeightClient(server.address) as watcher_client:
        stream = watcher_client.watch(MODEL, since=0, timeout=JOIN)

        def watch() -> None:
            try:
                for event in stream:
                    events.append(event.version)
                    if len(events) == total:
                        return
            finally:
                stream.close()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert subscribed.wait(10)
        start = threading.Barrier(publishers, timeout=JOIN)

        def publisher() -> None:
            with WeightClient(server.address) as client:
                start.wait()
                for _ in range(per_publisher):
                    client.publish({"w": torch.zeros(4)}, model=MODEL)

        run_threads([publisher for _ in range(publishers)])
        watcher.join(JOIN)
        assert not watcher.is_alive(), f"watcher stuck after {events}"
    assert events == list(range(1, total + 1))
