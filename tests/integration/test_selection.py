"""Selections end to end (issue 32): a transformers Llama built from a tiny config (no download),
split for 2 and 4 tensor-parallel ranks. Each rank's shards put back together along their
dimensions are the full tensors bit for bit, for several versions, over every transport, through
a relay, cast to BF16 and as deltas; a bad selection is INVALID_ARGUMENT naming what is at fault
with nothing sent, and the server keeps serving; a client that selects nothing is unaffected; the
updater applies a rank's shards to a policy that holds only them, in a buffer of their size."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import textwrap

import grpc
import pytest
import torch
from tensordict import TensorDict
from waiting import wait_until

from weightclient import LLAMA_PLAN, InvalidRequest, WeightClient, tensor_parallel
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightclient.torchrl.key_mapping import KeyMap
from weightserver.protocol.limits import MAX_SELECTION_RULES
from weightserver.protocol.selection import Selection, TensorRule
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

transformers = pytest.importorskip("transformers")

MODEL = "llm"
TRANSPORTS = ["stream", "bulk", "shm"]


def llama(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny Llama's state dict (random init from a config: nothing downloaded)."""
    config = transformers.LlamaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return {name: t.detach().clone() for name, t in transformers.LlamaForCausalLM(config).state_dict().items()}


def step(weights: dict[str, torch.Tensor], seed: int, fraction: float = 1.0) -> dict[str, torch.Tensor]:
    """The next version: `fraction` of the elements of every tensor but the norms changed."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        mask = torch.rand(tensor.shape, generator=generator) < fraction
        out[name] = tensor if "norm" in name else torch.where(mask, tensor + 0.01, tensor)
    return out


def dim_of(name: str) -> int | None:
    return next((dim for pattern, dim in LLAMA_PLAN.items() if fnmatch.fnmatchcase(name, pattern)), None)


def assert_shards_rebuild(shards: list[dict[str, torch.Tensor]], full: dict[str, torch.Tensor]) -> None:
    """Every rank has every tensor; the sliced ones concatenated along their dim are the full one."""
    for name, tensor in full.items():
        dim = dim_of(name)
        got = torch.cat([s[name] for s in shards], dim) if dim is not None else shards[0][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
        assert dim is not None or all(torch.equal(s[name], tensor) for s in shards), name


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def fetch_shards(client: WeightClient, version: int, world: int, **options) -> list:
    shards = (tensor_parallel(rank, world, LLAMA_PLAN) for rank in range(world))
    return [client.fetch(MODEL, version=version, select=select, **options) for select in shards]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_ranks_shards_rebuild_every_version_bit_for_bit_over_every_transport(server, client, transport):
    versions = [llama()]
    versions += [step(versions[-1], seed=1), step(versions[-1], seed=2)]
    for weights in versions:
        client.publish(weights, model=MODEL)
    for number, weights in enumerate(versions, start=1):
        for world in (2, 4):
            results = fetch_shards(client, number, world, transport=transport)
            assert all(r.version == number and r.stats.transport == transport for r in results)
            assert_shards_rebuild([r.tensors for r in results], weights)
            sent = sum(r.stats.wire_bytes for r in results)
            whole = server.store.get(MODEL, number).byte_size
            assert sent <= 1.05 * whole  # the ranks together move about one model, not `world`
            assert all(r.info.byte_size == r.data.nbytes == r.stats.wire_bytes for r in results)
            assert all(t.xxh3 for r in results for t in r.info.tensors)  # each slice's own digest


def test_a_relay_serves_selections_from_its_own_copy(make_server):
    primary = make_server()
    relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1)
    versions = [llama()]
    versions.append(step(versions[0], seed=5))
    with WeightClient(primary.address) as trainer, WeightClient(relay.address) as collector:
        for number, weights in enumerate(versions, start=1):
            trainer.publish(weights, model=MODEL)
            wait_until(lambda n=number: any(m.latest_version == n for m in relay.store.models()))
            for transport in TRANSPORTS:
                shards = fetch_shards(collector, number, 4, transport=transport)
                assert_shards_rebuild([r.tensors for r in shards], weights)
        on_relay, on_primary = relay.servicer.payloads.keys(), primary.servicer.payloads.keys()
        assert len({key[5] for key in on_relay} - {""}) == 4  # each rank's selection, built there
        assert not any(key[5] for key in on_primary)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_selection_cast_to_bf16_is_the_cast_of_the_shards(server, client, transport):
    v1 = llama()
    client.publish(v1, model=MODEL)
    results = fetch_shards(client, 1, 2, transport=transport, dtype="BF16")
    assert all(r.dtype == "BF16" for r in results)
    assert_shards_rebuild([r.tensors for r in results], {n: t.to(torch.bfloat16) for n, t in v1.items()})
    assert sum(r.stats.wire_bytes for r in results) < 0.55 * nbytes(v1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_selections_delta_is_against_the_same_selection_of_the_base(server, client, transport):
    v1 = llama()
    v2 = step(v1, seed=3, fraction=0.01)
    client.publish(v1, model=MODEL)
    client.publish(v2, model=MODEL)
    world, bases = 4, fetch_shards(client, 1, 4, transport=transport)
    results = [
        client.fetch(MODEL, version=2, base=base, select=tensor_parallel(r, world, LLAMA_PLAN), transport=transport)
        for r, base in enumerate(bases)
    ]
    assert all(r.base_version == 1 and not r.partial for r in results)
    assert_shards_rebuild([r.tensors for r in results], v2)
    assert sum(r.stats.wire_bytes for r in results) < nbytes(v2) // 5  # changed elements only
    partial = client.fetch(MODEL, version=2, base=1, select=tensor_parallel(0, 2, LLAMA_PLAN), transport=transport)
    assert partial.partial and not any("norm" in name for name in partial.tensors)  # unchanged: not sent


def test_a_client_that_selects_nothing_is_unaffected(server, client):
    v1 = llama()
    client.publish(v1, model=MODEL)
    with grpc.insecure_channel(server.address) as channel:
        messages = list(pb_grpc.WeightServiceStub(channel).Fetch(pb.FetchRequest(model=MODEL, version=1)))
    assert [m.WhichOneof("kind") for m in messages[:2]] == ["header", "chunk"]  # no payload message
    data = b"".join(m.chunk for m in messages[1:])
    assert len(data) == messages[0].header.byte_size == server.store.get(MODEL, 1).byte_size
    assert_shards_rebuild([client.fetch(MODEL, version=1).tensors], v1)


BAD = {
    "matches nothing": (Selection((TensorRule("*.nothing"),)), "rule glob '*.nothing' matches no tensor"),
    "dim out of range": (
        Selection((TensorRule("model.norm.weight", "name", dim=1, span=(0, 1)),)),
        "tensor 'model.norm.weight' of shape [64]: dim 1 out of range",
    ),
    "range beyond": (
        Selection((TensorRule("lm_head.weight", dim=0, span=(200, 251)),)),
        "range [200, 251) is not within [0, 250]",
    ),
    "disagree": (
        Selection((TensorRule("*.q_proj.weight", dim=0, shard=(0, 2)), TensorRule("model.layers.0.", "prefix"))),
        "disagree on tensor 'model.layers.0.self_attn.q_proj.weight'",
    ),
}
WIRE = {  # what a client of another language could send
    "rank >= world": (pb.Slice(dim=0, shard=pb.Shard(rank=4, world=4)), "0 <= rank < world"),
    "world = 0": (pb.Slice(dim=0, shard=pb.Shard(rank=0, world=0)), "need world >= 1"),
}


@pytest.mark.parametrize("case", [*BAD, *WIRE])
@pytest.mark.parametrize("rpc", ["Fetch", "Negotiate"])
def test_a_bad_selection_is_invalid_argument_naming_it_and_nothing_is_sent(server, client, case, rpc):
    client.publish(llama(), model=MODEL)
    if case in BAD:
        select = BAD[case][0].message()
    else:
        select = pb.Selection(rules=[pb.TensorRule(glob="*.q_proj.weight", slice=WIRE[case][0])])
    request = pb.FetchRequest(model=MODEL, select=select)
    channel, received = grpc.insecure_channel(server.address), []
    stub = pb_grpc.WeightServiceStub(channel)
    with channel, pytest.raises(grpc.RpcError) as error:
        if rpc == "Fetch":
            received.extend(stub.Fetch(request))
        else:
            stub.Negotiate(pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_BULK], fetch=request))
    assert received == []
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (BAD.get(case) or WIRE[case])[1] in error.value.details()
    with pytest.raises(InvalidRequest, match="select: "):
        client.fetch(MODEL, select=BAD[case][0] if case in BAD else Selection.from_message(select))
    assert client.fetch(MODEL, version=1, select="*.norm.weight").info.tensors  # still serving


@pytest.mark.parametrize("count", [MAX_SELECTION_RULES + 1, 200_000])
@pytest.mark.parametrize("rpc", ["Fetch", "Negotiate"])
def test_a_selection_over_the_rule_limit_is_invalid_argument_and_the_server_keeps_serving(
    server, client, other_client, rpc, count
):
    """More than MAX_SELECTION_RULES rules (a request of 200,000 is about 5 MB, under the 8 MiB limit)
    are INVALID_ARGUMENT naming the count and the limit, nothing sent; the client refuses them
    before any call. Before, the server took any number and matched every rule against every
    tensor name on its event loop, stalling every other client meanwhile."""
    client.publish(llama(), model=MODEL)
    names = [f"model.layers.{i}.w" for i in range(count)]
    request = pb.FetchRequest(model=MODEL, select=pb.Selection(rules=[pb.TensorRule(name=n) for n in names]))
    channel, received = grpc.insecure_channel(server.address), []
    stub = pb_grpc.WeightServiceStub(channel)
    with channel, pytest.raises(grpc.RpcError) as error:
        if rpc == "Fetch":
            received.extend(stub.Fetch(request, timeout=30))
        else:
            accept = [pb.TRANSPORT_BULK]
            stub.Negotiate(pb.NegotiateRequest(direction=pb.DIRECTION_FETCH, accept=accept, fetch=request), timeout=30)
    assert received == []
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"select: {count} rules, over the limit of {MAX_SELECTION_RULES}" in error.value.details()
    with WeightClient("127.0.0.1:1") as nowhere, pytest.raises(InvalidRequest, match=f"{count} rules, over the limit"):
        nowhere.fetch(MODEL, select=names)  # refused before any call: no server is asked
    with pytest.raises(InvalidRequest, match=f"{count} rules, over the limit"):
        client.fetch(MODEL, select=names)
    assert other_client.fetch(MODEL, version=1, select="*.norm.weight", timeout=30).info.tensors  # still serving


def shard_policy(rank: int, world: int, full: dict[str, torch.Tensor]) -> TensorDict:
    """A rank's policy: only its shards (zeros), under the keys of a module wrapped once more."""
    shards = {}
    for name, tensor in full.items():
        dim = dim_of(name)
        shard = tensor.chunk(world, dim)[rank] if dim is not None else tensor
        shards[f"module.{name}"] = torch.zeros_like(shard)
    return TensorDict(shards, batch_size=[])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_updater_applies_a_ranks_shards_in_a_buffer_of_their_size(server, client, transport):
    v1 = llama()
    v2 = step(v1, seed=4, fraction=0.01)
    world, rank = 4, 1
    policy = shard_policy(rank, world, v1)
    select = tensor_parallel(rank, world, LLAMA_PLAN)
    updater = GrpcLocalWeightUpdater(
        client, model=MODEL, policy=policy, select=select, key_map=KeyMap(add_prefix="module."),
        transport=transport, update_timeout=30,
    )  # fmt: skip
    client.publish(v1, model=MODEL)
    for number, weights in ((1, v1), (2, v2)):
        if number == 2:
            client.publish(v2, model=MODEL)
        update = updater.pull()
        assert update is not None and update.version == number
        selection_bytes = update.info.byte_size
        updater.apply(update)
        assert updater.version == number
        held = policy.flatten_keys(".")
        for name, tensor in weights.items():
            dim = dim_of(name)
            assert torch.equal(held[f"module.{name}"], tensor.chunk(world, dim)[rank] if dim is not None else tensor)
    assert selection_bytes < 0.35 * server.store.get(MODEL, 2).byte_size
    if transport == "shm":  # the selection's own file, read whole where it lies
        assert updater.last_fetch.wire_bytes == selection_bytes
    else:
        assert update.partial  # v2 came as a delta of the selection: the policy held the rest


def _peak_script() -> str:
    return textwrap.dedent(
        """
        import sys
        import torch
        from tensordict import TensorDict
        from weightclient import WeightClient, tensor_parallel
        from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater

        address, transport, side = sys.argv[1], sys.argv[2], int(sys.argv[3])
        shape = {"col": (side // 4, side), "row": (side, side // 4)}
        policy = TensorDict({f"{kind}.{i}": torch.full(shape[kind], 0.5) for kind in shape for i in range(4)})
        client = WeightClient(address)
        client.list_models()  # the channel up before the measurement
        select = tensor_parallel(1, 4, {"col.*": 0, "row.*": 1})
        updater = GrpcLocalWeightUpdater(client, model="big", policy=policy, select=select, transport=transport)


        def status(field):
            return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) << 10

        with open("/proc/self/clear_refs", "w") as peak:
            peak.write("5")  # the peak RSS (VmHWM) starts again from what the process holds now
        before = status("VmRSS")
        for version in (1, 2):
            if version == 2:
                sys.stdin.readline()
            update = updater.pull()
            assert update is not None and update.version == version, update
            updater.apply(update)
            if version == 1:
                print("applied", updater.version, flush=True)
        peak = status("VmHWM") - before
        held = sum(t.double().sum() for t in policy.values())
        print(peak, update.info.byte_size, float(held), flush=True)
        """
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_updaters_peak_memory_is_its_selections_not_the_models(server, client, transport):
    """Issue 32: an updater with a selection needs at most 1.2x the selection's bytes at its peak,
    for a whole version and for a delta, measured as the peak RSS its pulls and applies add in a
    fresh process whose policy holds rank 1 of 4's shards (every page touched). Without the
    selection it would receive the whole model: 4x. The model is the size of the issue's
    `sharded_fetch` row: 1 GiB, so a rank selects 256 MiB."""
    side = 5792  # 8 float32 matrices of 128 MiB: 1 GiB, of which a rank selects 256 MiB
    v1 = {f"{kind}.{i}": torch.full((side, side), 1.0) for kind in ("col", "row") for i in range(4)}
    v2 = {name: t.clone() for name, t in v1.items()}
    for tensor in v2.values():
        tensor[: side // 8] = 2.0  # an eighth of each row-parallel shard changes: a delta
    client.publish(v1, model="big")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-c", _peak_script(), server.address, transport, str(side)]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as child:
        try:
            assert child.stdout.readline().split() == ["applied", "1"]
            client.publish(v2, model="big")
            child.stdin.write("go\n")
            child.stdin.flush()
            added, selection_bytes, held = child.stdout.readline().split()
        finally:
            child.stdin.close()
            assert child.wait(timeout=120) == 0
    shards = [t.chunk(4, 0 if name.startswith("col") else 1)[1] for name, t in v2.items()]
    assert float(held) == float(sum(shard.double().sum() for shard in shards))
    assert int(selection_bytes) <= 0.26 * sum(t.nbytes for t in v1.values())
    # Measured at this size: shm 1.00x, bulk 1.04x (the staging buffer, and one tensor's element
    # delta at a time: the delta is rebuilt as it arrives), the stream 1.11-1.15x. What the stream
    # adds is gRPC's, and does not grow with the selection: its read-ahead (memray at the peak:
    # 8 MiB in its reader thread, 3 MiB of messages) and what glibc keeps of it in those threads'
    # arenas, 20-37 MiB in all. So for a 128 MiB selection the stream measured 1.15-1.29x.
    peak, selected = int(added), int(selection_bytes)
    assert peak <= 1.2 * selected, f"{peak >> 20} MiB at the peak for {selected >> 20} MiB selected"


def test_the_torchrl_scheme_passes_its_selection_to_the_updater():
    scheme = pytest.importorskip("weightclient.torchrl.scheme")
    select = tensor_parallel(0, 2, LLAMA_PLAN)
    assert scheme.GrpcWeightSyncScheme("localhost:1", select=select).puller.select == select
