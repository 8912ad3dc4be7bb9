"""Round trips through a real server: every dtype bit-exact, odd shapes and layouts, every
input kind, large multi-chunk models, safetensors interop, and the describe/list/admin rpcs."""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from datetime import UTC, datetime

import grpc
import pytest
import safetensors.torch
import torch
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tensordict import TensorDict
from waiting import wait_until

from weightclient import InvalidRequest, ModelNotFound, VersionEvicted, VersionNotFound, WeightClient
from weightclient import tensors as tensor_codec
from weightserver.protocol.limits import DEFAULT_CHUNK_BYTES, MiB
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
ALL_DTYPES = [*FLOAT_DTYPES, *INT_DTYPES, torch.bool]
SAFETENSORS_NAMES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# ---------------------------------------------------------------------- helpers
def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of `dtype`: for floats every bit pattern, so NaNs with payloads, infinities,
    subnormals and negative zero all occur; bools are 0/1."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def with_special_floats(tensor: torch.Tensor) -> torch.Tensor:
    """Put distinct NaN payloads, +-inf and -0.0 at the front of a 1-d float tensor."""
    out = tensor.clone()
    itemsize = out.element_size()
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    bits = out.view(int_dtype)
    if out.dtype == torch.float32:
        specials = [0x7FC00001, 0x7F800123, 0xFFC0BEEF - (1 << 32), 0x7F800000, 0xFF800000 - (1 << 32), -(1 << 31)]
    elif out.dtype == torch.float64:
        specials = [
            0x7FF8000000000001,
            0x7FF0000000001234,
            0x7FF8DEADBEEF0000,
            0x7FF0000000000000,
            -(1 << 63) + 0x7FF0000000000000,
            -(1 << 63),
        ]
    elif out.dtype == torch.float16:
        specials = [0x7E01, 0x7C23, 0xFE55 - (1 << 16), 0x7C00, 0xFC00 - (1 << 16), -(1 << 15)]
    else:  # bfloat16
        specials = [0x7FC1, 0x7F81, 0xFFD5 - (1 << 16), 0x7F80, 0xFF80 - (1 << 16), -(1 << 15)]
    bits[: len(specials)] = torch.tensor(specials, dtype=int_dtype)
    return out


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert actual.is_contiguous()
    a = actual.contiguous().reshape(-1).view(torch.uint8)
    e = expected.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, e), f"bytes differ for {expected.dtype} {tuple(expected.shape)}"


def encoded_bytes(weights) -> bytes:
    return b"".join(bytes(p) for p in tensor_codec.encode(weights))


def raw_stub(address: str) -> tuple[grpc.Channel, pb_grpc.WeightServiceStub]:
    channel = grpc.insecure_channel(
        address,
        options=[("grpc.max_receive_message_length", 8 * MiB), ("grpc.max_send_message_length", 8 * MiB)],
    )
    return channel, pb_grpc.WeightServiceStub(channel)


# ---------------------------------------------------------------------- dtypes and shapes
def test_every_dtype_round_trips_bit_exact(client: WeightClient) -> None:
    weights = {}
    for i, dtype in enumerate(ALL_DTYPES):
        tensor = random_tensor(dtype, (257,), seed=i)
        if dtype in FLOAT_DTYPES:
            tensor = with_special_floats(tensor)
        weights[f"t_{SAFETENSORS_NAMES[dtype]}"] = tensor
    # Make sure the float tensors really carry NaNs (so a value-based compare would be wrong).
    for dtype in FLOAT_DTYPES:
        assert torch.isnan(weights[f"t_{SAFETENSORS_NAMES[dtype]}"]).any()

    version = client.publish(weights, model="dtypes")
    result = client.fetch("dtypes", version=version)
    assert result is not None
    fetched = result.state_dict()
    assert set(fetched) == set(weights)
    for name, expected in weights.items():
        assert_bit_equal(fetched[name], expected)
        # torch.equal with equal_nan semantics is not enough for payloads; also check values.
        if expected.dtype in FLOAT_DTYPES:
            assert torch.equal(torch.isnan(fetched[name]), torch.isnan(expected))
    info = {t.name: t for t in result.info.tensors}
    for name, expected in weights.items():
        assert info[name].dtype == SAFETENSORS_NAMES[expected.dtype]
        assert info[name].shape == tuple(expected.shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_zero_dim_and_empty_tensors(client: WeightClient, dtype: torch.dtype) -> None:
    weights = {
        "scalar": random_tensor(dtype, (), seed=1),
        "empty": torch.empty((0,), dtype=dtype),
        "empty_2d": torch.empty((3, 0), dtype=dtype),
        "one": random_tensor(dtype, (1,), seed=2),
    }
    version = client.publish(weights, model="shapes")
    result = client.fetch("shapes", version=version)
    assert result is not None
    fetched = result.state_dict()
    assert fetched["scalar"].dim() == 0
    assert fetched["empty"].shape == (0,)
    assert fetched["empty_2d"].shape == (3, 0)
    for name, expected in weights.items():
        assert_bit_equal(fetched[name], expected)
    shapes = {t.name: t.shape for t in result.info.tensors}
    assert shapes == {"scalar": (), "empty": (0,), "empty_2d": (3, 0), "one": (1,)}


def test_non_contiguous_tensors(client: WeightClient) -> None:
    base = random_tensor(torch.float32, (6, 10), seed=3)
    weights = {
        "transposed": base.t(),
        "stepped": base[:, ::3],
        "row_stepped": base[::2],
        "expanded": torch.arange(4, dtype=torch.int64).expand(3, 4),
        "permuted": random_tensor(torch.bfloat16, (2, 3, 4), seed=4).permute(2, 0, 1),
        "column": random_tensor(torch.int16, (7, 3), seed=5)[:, 1],
    }
    assert not weights["transposed"].is_contiguous()
    assert not weights["stepped"].is_contiguous()
    assert not weights["expanded"].is_contiguous()
    assert not weights["permuted"].is_contiguous()
    assert not weights["column"].is_contiguous()
    version = client.publish(weights, model="layouts")
    result = client.fetch("layouts", version=version)
    assert result is not None
    fetched = result.state_dict()
    for name, expected in weights.items():
        got = fetched[name]
        assert got.is_contiguous(), name
        assert got.shape == expected.shape, name
        assert_bit_equal(got, expected)


@pytest.mark.parametrize(
    "make", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr, lambda t: torch.nested.as_nested_tensor([t])]
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_a_tensor_with_no_safetensors_form_is_refused_naming_its_key(make) -> None:
    """Sparse and nested tensors: InvalidRequest naming the key, snapshot or not (before, torch's
    RuntimeError "unsupported memory format option Contiguous", "Sparse CSR tensors do not have
    is_contiguous" or "Internal error: NestedTensorImpl doesn't support sizes. Please file an issue")."""
    weights = {"dense": torch.ones(3), "odd": make(torch.eye(3))}
    for frame in (tensor_codec.encode, tensor_codec.snapshot):
        with pytest.raises(InvalidRequest, match=r"key 'odd': a .* tensor has no safetensors form; publish it dense"):
            frame(weights)


# ---------------------------------------------------------------------- input kinds
def _net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def test_publish_module_and_load_into_fresh_module(client: WeightClient) -> None:
    torch.manual_seed(0)
    source = _net()
    version = client.publish(source, model="policy", metadata={"step": "100"})
    result = client.fetch("policy")
    assert result is not None
    assert result.version == version
    assert result.metadata == {"step": "100"}
    assert set(result.state_dict()) == set(source.state_dict())

    torch.manual_seed(1)
    fresh = _net()
    x = torch.randn(5, 8)
    assert not torch.equal(fresh(x), source(x))
    fresh.load_state_dict(result.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x), source(x))


def test_publish_plain_state_dict(client: WeightClient) -> None:
    state = {"w": torch.randn(3, 4), "b": torch.arange(3, dtype=torch.int32), "flag": torch.tensor(True)}
    version = client.publish(state, model="plain")
    result = client.fetch("plain", version=version)
    assert result is not None
    fetched = result.state_dict()
    assert set(fetched) == set(state)
    for name, expected in state.items():
        assert_bit_equal(fetched[name], expected)


def test_publish_nested_tensordict_flattens_keys(client: WeightClient) -> None:
    td = TensorDict(
        {
            "actor": {"net": {"weight": torch.randn(4, 3), "bias": torch.randn(4)}},
            "critic": {"weight": torch.randn(1, 3)},
            "log_std": torch.zeros(2),
        },
        batch_size=[],
    )
    version = client.publish(td, model="td")
    result = client.fetch("td", version=version)
    assert result is not None
    expected = {
        "actor.net.weight": td["actor", "net", "weight"],
        "actor.net.bias": td["actor", "net", "bias"],
        "critic.weight": td["critic", "weight"],
        "log_std": td["log_std"],
    }
    weights = result.weights
    assert isinstance(weights, TensorDict)
    assert set(weights.keys()) == set(expected)
    for name, tensor in expected.items():
        assert_bit_equal(weights[name], tensor)
    nested = weights.unflatten_keys(".")
    assert torch.equal(nested["actor", "net", "weight"], td["actor", "net", "weight"])


# ---------------------------------------------------------------------- large models
def test_large_model_streams_in_chunks(server, client: WeightClient) -> None:
    weights = {f"layer{i}": random_tensor(torch.float32, (4 * 1024 * 1024,), seed=10 + i) for i in range(4)}
    weights["tail"] = random_tensor(torch.float16, (12345,), seed=20)  # not a multiple of a chunk
    total = sum(t.numel() * t.element_size() for t in weights.values())
    assert total > 64 * MiB
    version = client.publish(weights, model="big")

    assert client.chunk_bytes == DEFAULT_CHUNK_BYTES == 1 * MiB
    result = client.fetch("big")
    assert result is not None
    assert result.version == version
    assert result.info.byte_size > 64 * MiB > 4 * MiB
    for name, expected in weights.items():
        assert_bit_equal(result.state_dict()[name], expected)

    # Count the chunk messages on the wire with a raw stub and the server default chunk size.
    channel, stub = raw_stub(server.address)
    with channel:
        messages = list(stub.Fetch(pb.FetchRequest(model="big"), timeout=60))
    assert messages[0].WhichOneof("kind") == "header"
    chunks = [m.chunk for m in messages[1:]]
    assert all(m.WhichOneof("kind") == "chunk" for m in messages[1:])
    size = messages[0].header.byte_size
    assert len(chunks) == math.ceil(size / MiB) >= 64
    assert all(0 < len(c) <= MiB for c in chunks)
    data = b"".join(chunks)
    assert len(data) == size
    assert hashlib.sha256(data).hexdigest() == messages[0].header.sha256  # a Fetch header always carries it
    assert messages[0].header.xxh3 == result.info.xxh3
    assert data == bytes(result.data)


# ---------------------------------------------------------------------- safetensors interop
def test_safetensors_file_publishes_and_fetches_identically(client: WeightClient, tmp_path) -> None:
    originals = {
        "embed": torch.randn(32, 16),
        "proj": torch.randn(16, 8, dtype=torch.float64),
        "half": torch.randn(5, 3).half(),
        "bf": torch.randn(7).bfloat16(),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "small": torch.arange(-3, 4, dtype=torch.int8),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(originals, str(path), metadata={"format": "pt"})
    file_bytes = path.read_bytes()

    info = client.publish_bytes("st", file_bytes, metadata={"source": "safetensors"})
    assert info.xxh3 == xxhash.xxh3_128_hexdigest(file_bytes)
    assert info.sha256 in ("", hashlib.sha256(file_bytes).hexdigest())  # "" while the server computes it
    assert info.byte_size == len(file_bytes)

    fetched = client.fetch_bytes("st", version=info.version)
    assert fetched is not None
    assert bytes(fetched.data) == file_bytes
    assert hashlib.sha256(fetched.data).hexdigest() == hashlib.sha256(file_bytes).hexdigest()
    loaded = safetensors.torch.load(bytes(fetched.data))
    assert set(loaded) == set(originals)
    for name, expected in originals.items():
        assert_bit_equal(loaded[name], expected)

    # The tensor client decodes the same file.
    result = client.fetch("st", version=info.version)
    assert result is not None
    for name, expected in originals.items():
        assert_bit_equal(result.state_dict()[name], expected)


def test_client_encoding_loads_with_safetensors() -> None:
    weights = {
        "a": random_tensor(torch.float32, (3, 5), seed=30),
        "b": random_tensor(torch.bfloat16, (9,), seed=31),
        "c": random_tensor(torch.int64, (2, 2), seed=32),
        "d": random_tensor(torch.bool, (5,), seed=33),
        "e": random_tensor(torch.uint8, (3,), seed=34),
        "f": torch.empty((0, 4)),
        "g": random_tensor(torch.float16, (), seed=35),
        "h": random_tensor(torch.float32, (4, 6), seed=36).t(),
    }
    loaded = safetensors.torch.load(encoded_bytes(weights))
    assert set(loaded) == set(weights)
    for name, expected in weights.items():
        assert_bit_equal(loaded[name], expected)


# ---------------------------------------------------------------------- fetch selectors
def test_fetch_newer_than_current_is_none_and_sends_no_bytes(server, client: WeightClient) -> None:
    client.publish({"w": torch.ones(1000)}, model="m")
    latest = client.publish({"w": torch.full((1000,), 2.0)}, model="m")
    assert client.fetch("m", newer_than=latest) is None
    older = client.fetch("m", newer_than=latest - 1)
    assert older is not None
    assert older.version == latest

    channel, stub = raw_stub(server.address)
    with channel:
        messages = list(stub.Fetch(pb.FetchRequest(model="m", newer_than=latest), timeout=10))
    assert len(messages) == 1
    assert messages[0].WhichOneof("kind") == "up_to_date"
    assert messages[0].up_to_date.latest_version == latest


def test_fetch_exact_version(client: WeightClient) -> None:
    for i in range(1, 4):
        assert client.publish({"w": torch.full((8,), float(i))}, model="m", metadata={"i": str(i)}) == i
    for i in (2, 1, 3):
        result = client.fetch("m", version=i)
        assert result is not None
        assert result.version == i
        assert result.metadata == {"i": str(i)}
        assert torch.equal(result.state_dict()["w"], torch.full((8,), float(i)))
    latest = client.fetch("m")
    assert latest is not None
    assert latest.version == 3


def test_get_latest_and_describe_report_the_published_version(client: WeightClient) -> None:
    weights = {
        "w": torch.randn(4, 3),
        "b": torch.zeros(4, dtype=torch.float64),
        "n": torch.tensor(7, dtype=torch.int16),
    }
    data = encoded_bytes(weights)
    before = datetime.now(UTC)
    version = client.publish(weights, model="desc", metadata={"step": "42", "run": "abc"})
    after = datetime.now(UTC)
    expected_manifest = {"w": ("F32", (4, 3)), "b": ("F64", (4,)), "n": ("I16", ())}

    wait_until(lambda: client.describe("desc", version).sha256 != "")  # computed after the commit
    latest = client.latest("desc")  # GetLatest
    described = client.describe("desc", version)  # Describe, exact version
    described_latest = client.describe("desc")  # Describe, 0 = latest
    for info in (latest, described, described_latest):
        assert info.model == "desc"
        assert info.version == version
        assert info.byte_size == len(data)
        assert info.sha256 == hashlib.sha256(data).hexdigest()
        assert before.timestamp() - 1 <= info.created.timestamp() <= after.timestamp() + 1
        assert info.metadata == {"step": "42", "run": "abc"}
        assert {t.name: (t.dtype, t.shape) for t in info.tensors} == expected_manifest
        assert info.pinned is False
        # Tensors come in the order of their byte offsets and tile the data section.
        spans = [(t.begin, t.end) for t in info.tensors]
        assert spans == sorted(spans)
        assert spans[0][0] == 0
        assert all(a_end == b_begin for (_, a_end), (b_begin, _) in itertools.pairwise(spans))
        header_len = int.from_bytes(data[:8], "little")
        assert 8 + header_len + spans[-1][1] == info.byte_size
    assert latest == described == described_latest

    client.publish({"x": torch.ones(2)}, model="desc")
    newer = client.latest("desc")
    assert newer.version == version + 1
    assert client.describe("desc").version == version + 1
    assert {t.name: (t.dtype, t.shape) for t in newer.tensors} == {"x": ("F32", (2,))}
    assert newer.created >= described.created
    assert client.describe("desc", version) == described  # older versions keep their description
    fetched = client.fetch("desc", version=version)
    assert fetched is not None
    assert fetched.info == described


# ---------------------------------------------------------------------- admin rpcs
def test_list_models_and_versions(client: WeightClient) -> None:
    assert client.list_models() == []
    sizes = {}
    for model, count in (("critic", 2), ("actor", 3)):
        for i in range(count):
            client.publish({"w": torch.full((16 * (i + 1),), float(i))}, model=model)
        sizes[model] = [v.byte_size for v in client.list_versions(model)]
    summaries = client.list_models()
    assert [s.model for s in summaries] == ["actor", "critic"]  # sorted by name
    actor, critic = summaries
    assert (actor.latest_version, actor.version_count, actor.retained_bytes) == (3, 3, sum(sizes["actor"]))
    assert (critic.latest_version, critic.version_count, critic.retained_bytes) == (2, 2, sum(sizes["critic"]))
    assert [v.version for v in client.list_versions("actor")] == [1, 2, 3]
    with pytest.raises(ModelNotFound):
        client.list_versions("nobody")


def test_delete_version(client: WeightClient) -> None:
    for i in range(1, 4):
        client.publish({"w": torch.full((4,), float(i))}, model="m")
    deleted = client.delete("m", 2)
    assert deleted.version == 2
    assert [v.version for v in client.list_versions("m")] == [1, 3]
    with pytest.raises(VersionNotFound, match="deleted"):
        client.fetch("m", version=2)
    # Deleting the latest keeps the numbering above every version ever committed.
    client.delete("m", 3)
    assert client.latest("m").version == 1
    assert client.publish({"w": torch.zeros(4)}, model="m") == 4
    assert [v.version for v in client.list_versions("m")] == [1, 4]


def test_pin_keeps_a_version_beyond_keep(make_server) -> None:
    srv = make_server(keep=2)
    with WeightClient(srv.address) as client:
        client.publish({"w": torch.full((4,), 1.0)}, model="m")
        pinned = client.pin("m", 1)
        assert pinned.pinned is True
        assert client.describe("m", 1).pinned is True
        for i in range(2, 6):
            client.publish({"w": torch.full((4,), float(i))}, model="m")
        assert [v.version for v in client.list_versions("m")] == [1, 4, 5]
        result = client.fetch("m", version=1)
        assert result is not None
        assert torch.equal(result.state_dict()["w"], torch.full((4,), 1.0))
        with pytest.raises(VersionEvicted):
            client.fetch("m", version=2)

        unpinned = client.pin("m", 1, pinned=False)
        assert unpinned.pinned is False
        assert [v.version for v in client.list_versions("m")] == [4, 5]  # evicted at once
        with pytest.raises(VersionEvicted):
            client.fetch("m", version=1)

        # Pinning at publish time.
        v = client.publish({"w": torch.zeros(4)}, model="m", pin=True)
        assert client.describe("m", v).pinned is True
        client.publish({"w": torch.zeros(4)}, model="m")
        client.publish({"w": torch.zeros(4)}, model="m")
        assert v in [info.version for info in client.list_versions("m")]


# ---------------------------------------------------------------------- health and reflection
def test_health_reports_serving(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "weightserver.v1.WeightService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_weight_service(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    assert len(responses) == 1
    names = {s.name for s in responses[0].list_services_response.service}
    assert "weightserver.v1.WeightService" in names
    assert "grpc.health.v1.Health" in names


def test_created_time_is_recent(client: WeightClient) -> None:
    start = time.time()
    client.publish({"w": torch.ones(1)}, model="clock")
    created = client.latest("clock").created
    assert created.tzinfo is not None
    assert start - 1 <= created.timestamp() <= time.time() + 1


@pytest.mark.parametrize("transport", ["stream", "bulk", "shm"])
def test_a_server_bound_to_an_ipv6_address_is_dialled_at_its_address(make_server, transport) -> None:
    """`WeightServer.address` of a server on ::1 is [::1]:port (before: ::1:port, which no client
    could dial), and each transport works there."""
    server = make_server(host="::1")
    assert server.address == f"[::1]:{server.port}"
    weights = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    with WeightClient(server.address, timeout=10) as c:
        version = c.publish(weights, transport=transport)
        fetched = c.fetch(version=version, transport=transport)
    assert fetched.stats.transport == transport and torch.equal(fetched.weights["w"], weights["w"])
