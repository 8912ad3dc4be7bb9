"""Placed fetches: a whole version received straight into caller-owned tensors (the live
policy) over bulk TCP and shared memory, verified there, with a normal fetch as fallback."""

from __future__ import annotations

import os

import pytest
import torch

from weightclient import IntegrityError, WeightClient
from weightclient.placement import layout
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightclient.torchrl.key_mapping import KeyMap
from weightserver.protocol.version_info import TensorInfo, VersionInfo

MODEL = "policy"


def mixed_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Several dtypes and an odd-sized tensor, so that offsets are not all multiples of 4."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 257, generator=g),
        "a.bias": torch.randn(257, generator=g).to(torch.float64),
        "b.half": torch.randn(33, generator=g).to(torch.bfloat16),
        "b.steps": torch.randint(0, 1000, (7,), generator=g),
        "b.mask": torch.rand(5, generator=g) > 0.5,
        "c.scalar": torch.tensor(3.5),
    }


def blank_like(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in weights.items()}


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("transport", ["bulk", "shm"])
def test_placed_fetch_writes_into_the_given_tensors_bit_exactly(server, client, transport):
    weights = mixed_weights()
    version = client.publish(weights, model=MODEL)
    targets = blank_like(weights)
    seen: list[int] = []

    def place(info: VersionInfo) -> dict[str, torch.Tensor]:
        seen.append(info.version)
        return targets

    result = client.fetch(MODEL, transport=transport, place=place)
    assert seen == [version]
    assert result.placed and result.stats.transport == transport
    assert result.data.nbytes == 0  # no receive buffer was used
    assert all(result.tensors[name] is targets[name] for name in targets)
    assert_same(targets, weights)


@pytest.mark.parametrize("transport", ["bulk", "shm"])
def test_placing_a_subset_drops_the_other_tensors(server, client, transport):
    weights = mixed_weights()
    client.publish(weights, model=MODEL)
    wanted = {"a.bias": torch.zeros_like(weights["a.bias"]), "b.steps": torch.zeros_like(weights["b.steps"])}
    result = client.fetch(MODEL, transport=transport, place=lambda info: wanted)
    assert result.placed and sorted(result.tensors) == ["a.bias", "b.steps"]
    assert_same(wanted, {k: weights[k] for k in wanted})


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda t: {**t, "a.bias": t["a.bias"].float()}, id="wrong-dtype"),
        pytest.param(lambda t: {**t, "a.weight": torch.zeros(257, 300)}, id="wrong-shape"),
        pytest.param(lambda t: {**t, "a.weight": torch.zeros(257, 300).t()}, id="not-contiguous"),
        pytest.param(lambda t: {**t, "no.such": torch.zeros(1)}, id="unknown-name"),
        pytest.param(lambda t: None, id="declined"),
    ],
)
def test_a_placement_that_does_not_fit_gets_a_normal_fetch_and_leaves_targets_alone(server, client, spoil):
    weights = mixed_weights()
    client.publish(weights, model=MODEL)
    targets = spoil(blank_like(weights))
    before = {k: v.clone() for k, v in (targets or {}).items()}
    result = client.fetch(MODEL, transport="bulk", place=lambda info: targets)
    assert not result.placed and result.stats.transport == "bulk"
    assert_same(result.tensors, weights)
    assert_same(targets or {}, before)


def test_placement_is_not_offered_for_deltas_or_casts(server, client):
    weights = mixed_weights()
    first = client.publish(weights, model=MODEL)
    weights["a.bias"] += 1
    client.publish(weights, model=MODEL)
    calls: list[int] = []

    def place(info: VersionInfo) -> dict[str, torch.Tensor]:
        calls.append(info.version)
        return blank_like(weights)

    delta = client.fetch(MODEL, base=first, transport="bulk", place=place)
    assert delta.partial and not delta.placed
    cast = client.fetch(MODEL, dtype="BF16", transport="bulk", place=place)
    assert not cast.placed
    assert calls == []
    streamed = client.fetch(MODEL, transport="stream", place=place)  # the version itself: placed
    assert streamed.placed and calls == [2]


def test_placed_bytes_that_fail_their_digests_are_fetched_again(make_server, tmp_path):
    """After a restart a version is served from memory loaded off disk and its shared-memory
    file is a copy. A damaged copy fails the placed tensors' digests: the client stops using
    shared memory for a while and receives the version over the stream, intact."""
    weights = mixed_weights()
    first = make_server(data_dir=str(tmp_path))
    with WeightClient(first.address) as c:
        c.publish(weights, model=MODEL)
    first.stop(grace=0)
    server = make_server(data_dir=str(tmp_path))
    with WeightClient(server.address) as c:
        targets = blank_like(weights)
        assert c.fetch(MODEL, transport="shm", place=lambda info: targets).placed
        path = server.shared_memory.directory / MODEL / f"{1:012d}.safetensors"
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 3)
            f.write(b"\xff\xff\xff")
        result = c.fetch(MODEL, transport="shm", place=lambda info: blank_like(weights))
        assert result.placed and result.stats.transport == "stream"
        assert c.transports.usable("shm") is False
        assert_same(result.tensors, weights)


def test_updater_whose_fetch_fails_its_digests_keeps_its_version_and_recovers(server, client):
    """The updater receives into its staging buffer, never into the live parameters: a version
    that fails its digests raises and leaves the policy on the version it had."""
    policy = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    trainer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    updater = GrpcLocalWeightUpdater(server.address, policy=policy, transport="shm", delta=False)
    client.publish(trainer, model=MODEL)
    updater()
    assert updater.version == 1 and updater.last_fetch.transport == "shm"
    applied = {k: v.clone() for k, v in policy.state_dict().items()}

    with torch.no_grad():
        trainer[0].weight.add_(1.0)
    client.publish(trainer, model=MODEL, transport="bulk")  # a file the server wrote: root can damage it
    path = server.shared_memory.directory / MODEL / f"{2:012d}.safetensors"
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        f.write(b"\x00\x00\xc0\x7f")  # a NaN where the last bias was
    with pytest.raises(IntegrityError):
        updater()  # the stream serves the same (damaged) memory: refused
    assert updater.version == 1
    assert_same(dict(policy.state_dict()), applied)

    with torch.no_grad():
        trainer[1].bias.add_(1.0)
    client.publish(trainer, model=MODEL)
    updater()
    assert updater.version == 3
    assert_same(dict(policy.state_dict()), dict(trainer.state_dict()))
    updater.client.close()


def test_updater_copies_through_a_key_map_into_the_live_parameters(server, client):
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    policy = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    pointers = {name: p.data_ptr() for name, p in policy.state_dict().items()}
    client.publish({f"module.{k}": v for k, v in trainer.state_dict().items()}, model=MODEL)
    with WeightClient(server.address) as own:
        updater = GrpcLocalWeightUpdater(own, policy=policy, key_map=KeyMap(strip_prefix="module."), transport="bulk")
        updater()
        assert updater.version == 1 and updater.lag == 0 and updater.last_fetch.transport == "bulk"
    assert {name: p.data_ptr() for name, p in policy.state_dict().items()} == pointers
    assert_same(dict(policy.state_dict()), dict(trainer.state_dict()))


def test_layout_covers_the_file_exactly():
    tensors = (
        TensorInfo("x", "F32", (2,), 0, 8, "d"),
        TensorInfo("y", "U8", (3,), 8, 11, "d"),
        TensorInfo("z", "F32", (1,), 16, 20, "d"),  # a 5-byte gap before it
    )
    info = VersionInfo(MODEL, 1, 8 + 24 + 20 + 2, "", None, tensors=tensors)  # 2 trailing bytes
    views = {"x": memoryview(bytearray(8)), "z": memoryview(bytearray(4))}
    assert layout(info, views, 24) == [(24, None), (8, "x"), (3, None), (5, None), (4, "z"), (2, None)]
    with pytest.raises(ValueError):
        layout(info, views, 30)  # a header this long leaves no room for the tensors
    overlapping = (tensors[0], TensorInfo("w", "U8", (4,), 4, 8, "d"))
    with pytest.raises(ValueError):
        layout(VersionInfo(MODEL, 1, 40, "", None, tensors=overlapping), {}, 24)


@pytest.mark.parametrize("placed", [False, True])
def test_a_shared_memory_file_gone_before_it_is_read_is_asked_for_again(server, client, placed):
    """Eviction can remove a version's file between the server's reply and the client opening
    it. The client asks again (over the stream) for what it asked for, and keeps using shared
    memory afterwards: a vanished file says nothing about this host."""
    weights = mixed_weights()
    client.publish(weights, model=MODEL)
    assert client.fetch(MODEL, transport="shm").stats.transport == "shm"
    (server.shared_memory.directory / MODEL / f"{1:012d}.safetensors").unlink()
    place = (lambda info: blank_like(weights)) if placed else None
    result = client.fetch(MODEL, transport="shm", place=place)
    assert result.stats.transport == "stream" and result.version == 1
    assert_same(result.tensors, weights)
    assert client.transports.usable("shm") is True
    client.publish(mixed_weights(1), model=MODEL)
    assert client.fetch(MODEL, transport="shm").stats.transport == "shm"
