"""Element deltas end to end: real servers on loopback, real gRPC, real tensors. A collector that
holds the previous version gets each changed tensor as its changed elements (where smaller) over
every transport and through a relay, rebuilt bit for bit; a base that differs is fetched whole;
a malformed delta is refused and nothing is applied."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import grpc
import pytest
import torch
import xxhash
from waiting import wait_until

from weightclient import IntegrityError, ModelNotFound, WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightserver.protocol import deltas
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
TRANSPORTS = ["stream", "bulk", "shm"]


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        assert actual[name].dtype == want.dtype and tuple(actual[name].shape) == tuple(want.shape), name
        assert raw(actual[name]) == raw(want), name


def first_version(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor of each element size and kind (64 Ki elements each)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(1 << 16, generator=generator)
    return {
        "f32": values.clone(),
        "bf16": values.to(torch.bfloat16),
        "f16": values.to(torch.float16),
        "i64": torch.arange(1 << 16),
        "bool": values > 0,
        "still": values * 3,  # never changes
    }


def step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`fraction` of each tensor's elements (but `still`'s) changed."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        tensor = tensor.clone()
        mask = torch.rand(tensor.shape, generator=generator) < fraction
        if name != "still":
            tensor[mask] = ~tensor[mask] if tensor.dtype == torch.bool else tensor[mask] + 1
        out[name] = tensor
    return out


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_changed_elements_travel_and_rebuild_bit_exact_over_every_transport(server, client, transport):
    v1 = first_version()
    v2 = step(v1, 0.01, seed=1)  # a few elements of each
    v3 = step(v2, 1.0, seed=2)  # every element of each (but `still`)
    v4 = {name: t.clone() for name, t in v3.items()}  # nothing
    client.publish(v1, model=MODEL)
    base = client.fetch(MODEL, version=1, transport=transport)
    changed = set(v1) - {"still"}

    client.publish(v2, model=MODEL)
    second = client.fetch(MODEL, version=2, base=base, transport=transport)
    assert second.stats.transport == transport and second.base_version == 1 and not second.partial
    assert set(second.changed) == changed
    assert_bit_exact(second.tensors, v2)
    assert second.stats.wire_bytes < nbytes(v2) // 10  # about 1% of the elements, and their places

    client.publish(v3, model=MODEL)
    third = client.fetch(MODEL, version=3, base=second, transport=transport)
    assert_bit_exact(third.tensors, v3)
    assert third.stats.wire_bytes > nbytes(v3) - v3["still"].nbytes  # every element changed: whole tensors

    client.publish(v4, model=MODEL)
    fourth = client.fetch(MODEL, version=4, base=third, transport=transport)
    assert fourth.changed == () and fourth.stats.wire_bytes < 1024
    assert_bit_exact(fourth.tensors, v4)


def test_on_the_servers_host_the_default_maps_the_version_rather_than_rebuild_a_delta(server, client):
    """A delta saves bytes that are copied; on the server's host a version's file is mapped, not
    copied, and a rebuild would copy the base. So there "auto" reads the version whole (and says so),
    a transport named still gets the delta, and both are bit-exact."""
    v1 = first_version()
    v2 = step(v1, 0.01, seed=1)
    client.publish(v1, model=MODEL)
    base = client.fetch(MODEL, version=1)
    assert base.stats.transport == "shm"  # this is the server's host
    client.publish(v2, model=MODEL)
    whole = client.fetch(MODEL, version=2, base=base, consume_base=True)
    assert whole.stats.transport == "shm" and whole.base_version == 0 and whole.changed is None
    assert_bit_exact(whole.tensors, v2)
    assert_bit_exact(base.tensors, v1)  # not consumed: nothing was rebuilt in it
    delta = client.fetch(MODEL, version=2, base=base, transport="bulk")
    assert delta.base_version == 1 and delta.stats.wire_bytes < nbytes(v2) // 10
    assert_bit_exact(delta.tensors, v2)


def test_a_caller_that_declares_no_forms_gets_whole_tensors(server, client):
    """What a Node or C++ client sees: base_version without element_deltas is today's delta."""
    v1 = first_version()
    client.publish(v1, model=MODEL)
    client.publish(step(v1, 0.01, seed=1), model=MODEL)
    partial = client.fetch(MODEL, version=2, base=1)  # a version number: no bytes to rebuild on
    assert partial.partial and set(partial.tensors) == set(v1) - {"still"}
    assert partial.stats.wire_bytes > nbytes(v1) - v1["still"].nbytes


def test_a_base_from_another_server_is_fetched_whole(make_server):
    """Same model, same version number, other bytes: the server's base_xxh3 differs from the
    caller's, so the delta is not rebuilt on it; the version comes whole, correct."""
    old, new = make_server(), make_server()
    with WeightClient(old.address) as on_old, WeightClient(new.address) as on_new:
        on_old.publish(first_version(seed=5), model=MODEL)
        foreign = on_old.fetch(MODEL)
        v1 = first_version(seed=0)
        v2 = step(v1, 0.01, seed=1)
        on_new.publish(v1, model=MODEL)
        on_new.publish(v2, model=MODEL)
        result = on_new.fetch(MODEL, version=2, base=foreign)
        assert result.base_version == 0 and result.changed is None
        assert_bit_exact(result.tensors, v2)


def test_a_base_changed_since_it_was_fetched_is_not_built_on(server, client):
    v1 = first_version()
    v2 = step(v1, 0.01, seed=1)
    client.publish(v1, model=MODEL)
    client.publish(v2, model=MODEL)
    base = client.fetch(MODEL, version=1)
    base.tensors["still"].add_(1)  # e.g. the caller trained on it: the rebuild's xxh3 differs
    result = client.fetch(MODEL, version=2, base=base)
    assert result.base_version == 0
    assert_bit_exact(result.tensors, v2)


def test_deltas_in_other_forms_are_other_shared_memory_files(server, client):
    """Callers that accept other element delta forms get other payloads of the same delta. Each
    had its own key but one file name ("-elements"), so the second payload's file replaced the
    first's: the first caller read bytes that were not the payload it was described."""
    v1 = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0))}
    v2 = {"w": v1["w"].clone()}
    v2["w"][::4] += 1  # a quarter of the elements: sparse is smaller than the tensor, a bitmap smaller still
    client.publish(v1, model=MODEL)
    client.publish(v2, model=MODEL)

    def negotiate(forms: list[int]) -> pb.Payload:
        fetch = pb.FetchRequest(model=MODEL, version=2, base_version=1, element_deltas=forms)
        request = pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_SHARED_MEMORY], fetch=fetch)
        with grpc.insecure_channel(server.address) as channel:
            return pb_grpc.WeightServiceStub(channel).Negotiate(request, timeout=30).payload

    sparse = negotiate([pb.ELEMENT_DELTA_SPARSE])
    either = negotiate([pb.ELEMENT_DELTA_SPARSE, pb.ELEMENT_DELTA_BITMAP])
    assert sparse.xxh3 != either.xxh3  # two payloads (sparse, bitmap)
    for payload in (sparse, either):
        with open(payload.shared_memory.path, "rb") as file:
            assert xxhash.xxh3_128_hexdigest(file.read()) == payload.xxh3


def truncating(monkeypatch) -> None:
    """The server's encoder drops the last byte of every element delta it writes."""
    encode = deltas.encode

    def broken(*args, **kwargs):
        form, blob = encode(*args, **kwargs)
        return (form, bytes(blob)[:-1]) if form else (form, blob)

    monkeypatch.setattr(deltas, "encode", broken)


def test_a_corrupt_delta_is_refused_and_nothing_is_applied(server, client, monkeypatch, caplog):
    truncating(monkeypatch)
    v1 = first_version()
    v2 = step(v1, 0.01, seed=1)
    policy = {name: torch.zeros_like(t) for name, t in v1.items()}
    updater = GrpcLocalWeightUpdater(client, policy=policy, transport="bulk")
    client.publish(v1, model=MODEL)
    updater()
    assert updater.version == 1
    client.publish(v2, model=MODEL)

    base = client.fetch(MODEL, version=1)
    with pytest.raises(IntegrityError, match="truncated"):
        client.fetch(MODEL, version=2, base=base, transport="bulk")  # (on this host "auto" maps v2 whole)
    assert_bit_exact(base.tensors, v1)  # not rebuilt in place: the caller's base is untouched

    with caplog.at_level(logging.WARNING):
        updater()
    assert updater.version == 1 and "refused a malformed delta" in caplog.text
    assert_bit_exact(policy, v1)
    updater()  # without the held base it asks for the whole version, which no encoder touches
    assert updater.version == 2 and updater.last_fetch.wire_bytes >= nbytes(v2)
    assert_bit_exact(policy, v2)
    monkeypatch.undo()
    v3 = step(v2, 0.01, seed=3)
    client.publish(v3, model=MODEL)
    updater()  # and holds it again: deltas are back
    assert updater.version == 3 and updater.last_fetch.wire_bytes < nbytes(v3) // 10
    assert_bit_exact(policy, v3)


@pytest.mark.parametrize("transport", ["stream", "bulk"])
def test_an_updater_applies_element_deltas_in_place(server, client, transport):
    """Each version after the first travels as its changed elements, is rebuilt in the updater's
    staging buffer on the version before, and only the changed tensors are copied into the policy."""
    weights = first_version()
    policy = {name: torch.zeros_like(t) for name, t in weights.items()}
    updater = GrpcLocalWeightUpdater(client, policy=policy, transport=transport)
    client.publish(weights, model=MODEL)
    updater()
    assert updater.last_fetch.wire_bytes >= nbytes(weights)
    for seed in range(1, 4):
        weights = step(weights, 0.005, seed=seed)
        client.publish(weights, model=MODEL)
        updater()
        assert updater.version == seed + 1 and updater.last_fetch.transport == transport
        assert updater.last_fetch.wire_bytes < nbytes(weights) // 20
        assert_bit_exact(policy, weights)
        assert updater.pull() is None  # up to date: the version held stays the next delta's base


_DELTA_PEAK = """
import sys
import torch
from weightclient import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater

address, transport, side = sys.argv[1], sys.argv[2], int(sys.argv[3])
policy = {f"w{i}": torch.full((side, side), 0.5) for i in range(8)}
updater = GrpcLocalWeightUpdater(WeightClient(address), model="big", policy=policy, transport=transport)
updater()  # v1, whole: the staging buffer then holds it, the next delta's base


def status(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) << 10


with open("/proc/self/clear_refs", "w") as peak:
    peak.write("5")  # the peak RSS (VmHWM) starts again from what the process holds now
before = status("VmRSS")
print(updater.version, flush=True)
sys.stdin.readline()
updater()
print(status("VmHWM") - before, updater.version, updater.last_fetch.wire_bytes, flush=True)
"""


@pytest.mark.parametrize("transport", ["stream", "bulk"])
def test_a_delta_lands_in_the_held_version_as_it_arrives(server, client, transport):
    """A delta whose changed tensors come whole (6 of 8 changed everywhere: 96 of 128 MiB) is
    rebuilt in the updater's staging buffer as it arrives, never held as a payload of its own:
    the pull adds a fraction of the delta to the process's peak RSS. (Before: all of it, 1.76x the
    model over bulk and 1.95x over the stream, where now 1.01x and 1.16x.)"""
    side = 2048  # 8 float32 tensors of 16 MiB
    v1 = {f"w{i}": torch.full((side, side), 1.0) for i in range(8)}
    v2 = {name: t + 1 if int(name[1:]) < 6 else t for name, t in v1.items()}
    client.publish(v1, model="big")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-c", _DELTA_PEAK, server.address, transport, str(side)]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as child:
        try:
            assert child.stdout.readline().split() == ["1"]
            client.publish(v2, model="big")
            child.stdin.write("go\n")
            child.stdin.flush()
            added, version, wire_bytes = map(int, child.stdout.readline().split())
        finally:
            child.stdin.close()
            assert child.wait(timeout=120) == 0
    delta = 6 * v1["w0"].nbytes
    assert version == 2 and delta <= wire_bytes < delta + (1 << 20)  # the changed tensors, whole
    # Measured: bulk +0-1 MiB; the stream +2-3 MiB alone and +31 MiB once in a full run (gRPC's read-ahead
    # and what glibc keeps of it: test_selection.py); holding the delta whole added 93-95 MiB.
    bound = 0.1 if transport == "bulk" else 0.5
    assert added < bound * delta, f"the delta's pull added {added >> 20} MiB to the peak for a {delta >> 20} MiB delta"


def held(server) -> int:
    try:
        return server.store.latest(MODEL).version
    except ModelNotFound:
        return 0


def test_a_relay_fetches_and_serves_element_deltas(make_server):
    primary = make_server()
    relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1, metrics_port=0)
    v1 = first_version()
    v2 = step(v1, 0.01, seed=1)
    with WeightClient(primary.address) as trainer, WeightClient(relay.address) as collector:
        trainer.publish(v1, model=MODEL)
        wait_until(lambda: held(relay) == 1, timeout=10)
        base = collector.fetch(MODEL, version=1)
        trainer.publish(v2, model=MODEL)
        wait_until(lambda: held(relay) == 2, timeout=10)
        moved = relay.metrics.registry.get_sample_value(
            "weightserver_relay_fetch_bytes_total", {"model": MODEL, "payload": "delta"}
        )
        assert 0 < moved < nbytes(v2) // 10  # the relay's own fetch was an element delta
        result = collector.fetch(MODEL, version=2, base=base, transport="bulk")  # and serves one from its copy
        assert result.base_version == 1 and result.stats.wire_bytes < nbytes(v2) // 10
        assert_bit_exact(result.tensors, v2)
