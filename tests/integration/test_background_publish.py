"""publish(wait=False): snapshot semantics, coalescing, failures and shutdown, against a real
server (the background thread streams real publishes)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from weightclient import ServerUnavailable, WeightClient
from weightclient.core.background import PublishFuture

MODEL = "policy"
TIMEOUT = 30


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        assert actual[name].dtype == want.dtype and tuple(actual[name].shape) == tuple(want.shape), name
        assert raw(actual[name]) == raw(want), name


def model_weights(seed: int = 0, numel: int = 4096) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(numel, generator=gen),
        "b": torch.randn(64, generator=gen).bfloat16(),
        "steps": torch.tensor(seed, dtype=torch.int64),
    }


def marked(index: int, numel: int) -> dict[str, torch.Tensor]:
    """Weights whose every value says which submit they came from."""
    return {"w": torch.full((numel,), float(index)), "index": torch.tensor(index, dtype=torch.int64)}


def copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in weights.items()}


class Gate:
    """Holds the client's first background publish in flight until `release()`."""

    def __init__(self, client: WeightClient) -> None:
        self.entered = threading.Event()
        self._release = threading.Event()
        self.calls = 0
        send = client.publish_group_bytes

        def gated(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                self.entered.set()
                assert self._release.wait(TIMEOUT)
            return send(*args, **kwargs)

        client.publish_group_bytes = gated  # the background thread sends through this

    def release(self) -> None:
        self._release.set()


@pytest.fixture
def own_client(server) -> Iterator[WeightClient]:
    """A client this test may gate, break and close itself."""
    c = WeightClient(server.address)
    try:
        yield c
    finally:
        c.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- futures and snapshots
def test_publish_without_waiting_returns_a_future_of_the_version(client):
    weights = model_weights()
    future = client.publish(weights, model=MODEL, metadata={"step": "7"}, wait=False)
    assert isinstance(future, PublishFuture)
    assert future.result(timeout=TIMEOUT) == 1
    assert not future.superseded
    result = client.fetch(MODEL)
    assert result.version == 1 and result.metadata == {"step": "7"}
    assert_bit_exact(result.tensors, weights)
    assert client.publish(weights, model=MODEL, wait=False).result(timeout=TIMEOUT) == 2


def test_weights_changed_right_after_the_call_are_not_published(client):
    weights = model_weights(numel=1 << 20)
    before = copy(weights)
    future = client.publish(weights, model=MODEL, wait=False)
    for t in weights.values():
        t.add_(1)  # the trainer's next optimizer step, as soon as the call returns
    version = future.result(timeout=TIMEOUT)
    assert_bit_exact(client.fetch(MODEL, version=version).tensors, before)


def test_snapshot_holds_while_the_publish_waits_its_turn(own_client):
    gate = Gate(own_client)
    first, second = model_weights(1), model_weights(2)
    first_copy, second_copy = copy(first), copy(second)
    f1 = own_client.publish(first, model=MODEL, wait=False)
    assert gate.entered.wait(TIMEOUT)  # the first is in flight, the second will queue
    f2 = own_client.publish(second, model=MODEL, wait=False)
    for weights in (first, second):
        for t in weights.values():
            t.zero_()
    gate.release()
    assert (f1.result(timeout=TIMEOUT), f2.result(timeout=TIMEOUT)) == (1, 2)
    assert_bit_exact(own_client.fetch(MODEL, version=1).tensors, first_copy)
    assert_bit_exact(own_client.fetch(MODEL, version=2).tensors, second_copy)


def test_recycled_snapshot_buffers_never_leak_into_later_versions(client):
    """Snapshots land in buffers recycled from earlier publishes (larger, smaller, equal)."""
    sizes = [1 << 16, 1 << 18, 1 << 12, 1 << 18, 1 << 16, 1 << 18]
    published = []
    for seed, numel in enumerate(sizes):
        weights = model_weights(seed, numel)
        published.append((client.publish(weights, model=MODEL, wait=False).result(timeout=TIMEOUT), copy(weights)))
        for t in weights.values():
            t.zero_()
    with WeightClient(client.address) as reader:
        for version, weights in published[-3:]:  # the server keeps three
            assert_bit_exact(reader.fetch(MODEL, version=version).tensors, weights)


# ---------------------------------------------------------------------- coalescing
def test_publishes_waiting_behind_one_in_flight_coalesce_into_the_newest(own_client):
    gate = Gate(own_client)
    futures = [own_client.publish(marked(0, 1000), model=MODEL, wait=False)]
    assert gate.entered.wait(TIMEOUT)
    futures += [own_client.publish(marked(i, 1000), model=MODEL, wait=False) for i in range(1, 10)]
    assert not any(f.done() for f in futures)
    gate.release()
    assert own_client.flush(timeout=TIMEOUT)

    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [1] + [2] * 9
    assert [f.superseded for f in futures] == [False] + [True] * 8 + [False]
    assert [v.version for v in own_client.list_versions(MODEL)] == [1, 2]
    assert gate.calls == 2
    assert_bit_exact(own_client.fetch(MODEL, version=1).tensors, marked(0, 1000))
    assert_bit_exact(own_client.fetch(MODEL, version=2).tensors, marked(9, 1000))


def test_a_waiting_publish_is_replaced_only_by_one_of_the_same_models(own_client):
    """A publish of another model does not coalesce with a waiting one: both are published (before,
    the waiting policy publish was dropped and its future resolved to the critic's version 1, where
    policy v1 holds the first weights, superseded=True)."""
    gate = Gate(own_client)
    first = own_client.publish(marked(0, 100), model="policy", wait=False)
    assert gate.entered.wait(TIMEOUT)
    waiting = own_client.publish(marked(1, 100), model="policy", wait=False)
    other = own_client.publish(marked(2, 100), model="critic", wait=False)
    gate.release()
    assert own_client.flush(timeout=TIMEOUT)
    assert (first.result(), waiting.result(), other.result()) == (1, 2, 1) and not waiting.superseded
    assert_bit_exact(own_client.fetch("policy", version=2).tensors, marked(1, 100))
    assert_bit_exact(own_client.fetch("critic", version=1).tensors, marked(2, 100))


def test_a_burst_of_publishes_resolves_every_future_to_weights_at_least_as_new(make_server):
    srv = make_server(keep=20)
    numel = 2_000_000  # 8 MB: later submits arrive while earlier ones stream
    with WeightClient(srv.address) as c:
        futures = [c.publish(marked(i, numel), model=MODEL, wait=False) for i in range(10)]
        assert c.flush(timeout=TIMEOUT)
        assert all(f.done() for f in futures)  # none left pending after flush()

        versions = [f.result() for f in futures]
        assert versions == sorted(versions)
        carried = {v: int(c.fetch(MODEL, version=v).tensors["index"]) for v in set(versions)}
        for i, (future, version) in enumerate(zip(futures, versions, strict=True)):
            if future.superseded:
                assert carried[version] > i, (i, version)
            else:
                assert carried[version] == i, (i, version)
        assert not futures[-1].superseded
        assert carried[versions[-1]] == 9
        assert_bit_exact(c.fetch(MODEL).tensors, marked(9, numel))
        assert [v.version for v in c.list_versions(MODEL)] == sorted(set(versions))


# ---------------------------------------------------------------------- failure and shutdown
def test_a_publish_to_an_unreachable_server_raises_from_its_future():
    c = WeightClient(f"127.0.0.1:{closed_port()}")
    try:
        future = c.publish(model_weights(), model=MODEL, wait=False)
        with pytest.raises(ServerUnavailable):
            future.result(timeout=TIMEOUT)
        assert c.flush(timeout=TIMEOUT)
    finally:
        c.close()


def test_a_failed_publish_fails_every_future_it_carried():
    c = WeightClient(f"127.0.0.1:{closed_port()}")
    try:
        gate = Gate(c)
        futures = [c.publish(model_weights(0), model=MODEL, wait=False)]
        assert gate.entered.wait(TIMEOUT)
        futures += [c.publish(model_weights(i), model=MODEL, wait=False) for i in (1, 2)]
        gate.release()
        for future in futures:
            with pytest.raises(ServerUnavailable):
                future.result(timeout=TIMEOUT)
        assert [f.superseded for f in futures] == [False, True, False]
    finally:
        c.close()


def test_close_sends_what_is_queued_first(server):
    c = WeightClient(server.address)
    gate = Gate(c)
    futures = [c.publish(marked(0, 1000), model=MODEL, wait=False)]
    assert gate.entered.wait(TIMEOUT)
    futures.append(c.publish(marked(1, 1000), model=MODEL, wait=False))
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(timeout=0.3)
    assert closer.is_alive()  # waiting for the publish in flight and the queued one
    gate.release()
    closer.join(timeout=TIMEOUT)
    assert not closer.is_alive()

    assert [f.result(timeout=0) for f in futures] == [1, 2]
    with WeightClient(server.address) as reader:
        assert_bit_exact(reader.fetch(MODEL).tensors, marked(1, 1000))
    with pytest.raises(RuntimeError, match="closed"):
        c.publish(marked(2, 1000), model=MODEL, wait=False)


# ---------------------------------------------------------------------- groups
def test_group_publish_without_waiting_commits_one_version_for_both(client):
    client.publish(model_weights(9), model="critic")  # the group goes above every member's latest
    policy, critic = model_weights(1), model_weights(2, numel=100)
    expected = {"policy": copy(policy), "critic": copy(critic)}
    future = client.publish_group({"policy": policy, "critic": critic}, wait=False)
    for t in [*policy.values(), *critic.values()]:
        t.zero_()
    version = future.result(timeout=TIMEOUT)

    assert version == 2
    for model, weights in expected.items():
        info = client.latest(model)
        assert info.version == version and sorted(info.group) == ["critic", "policy"]
        assert_bit_exact(client.fetch(model, version=version).tensors, weights)


def test_a_snapshot_is_the_encoded_file_byte_for_byte():
    """The snapshot copies tensors with torch straight into its buffer: byte-identical to the
    zero-copy encoding (and to the safetensors package), with non-contiguous, empty, bool and
    half tensors, into a recycled buffer larger than needed."""
    import safetensors.torch

    from weightclient import tensors as tensor_codec

    gen = torch.Generator().manual_seed(0)
    weights = {
        "big": torch.randn(3_000_000, generator=gen),  # 12 MB: many blocks
        "transposed": torch.randn(700, 900, generator=gen).t(),  # non-contiguous
        "half": torch.randn(5000, generator=gen).half(),
        "mask": torch.rand(1001, generator=gen) > 0.5,
        "empty": torch.empty(0, 3),
        "steps": torch.tensor(7),
    }
    expected = b"".join(bytes(part) for part in tensor_codec.encode(weights, {"step": "7"}))
    spare = memoryview(bytearray(len(expected) + 4096))
    snapshot = tensor_codec.snapshot(weights, {"step": "7"}, into=spare)
    assert bytes(snapshot) == expected
    loaded = safetensors.torch.load(bytes(snapshot))
    assert_bit_exact(loaded, {name: t.contiguous() for name, t in weights.items()})


def test_framing_reuses_a_header_only_for_the_same_layout_and_metadata():
    import json

    from weightclient import tensors as tensor_codec

    def header_of(weights, metadata=None) -> dict:
        prefix = bytes(tensor_codec.encode(weights, metadata)[0])
        return json.loads(prefix[8:])

    a = {"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64)}
    first = header_of(a, {"step": "1"})
    assert header_of(a, {"step": "1"}) == first  # cached
    assert header_of(a, {"step": "2"})["__metadata__"] == {"step": "2"}
    reshaped = header_of({"w": torch.zeros(2, 5), "b": torch.zeros(3, dtype=torch.int64)}, {"step": "1"})
    assert reshaped["w"]["shape"] == [2, 5] and first["w"]["shape"] == [10]
    retyped = header_of({"w": torch.zeros(10, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.int64)})
    start, end = retyped["w"]["data_offsets"]
    assert retyped["w"]["dtype"] == "F64" and end - start == 80
    # Metadata that cannot be a cache key is framed without the cache, not refused by it.
    assert header_of(a, {"tags": ["x"]})["__metadata__"] == {"tags": ["x"]}
