"""Health and server reflection work from standard tools (grpcurl, grpcui, Postman, ...).

Such tools know nothing of weights.proto: they ask the server's reflection service for the
service list and the file descriptors, build message types at run time, and call methods by
name. The generic client below does the same in a separate Python process that never imports
weightserver or weightclient (the fixtures run the server in this process, so only a fresh
process can show that no generated stub was needed). It uses grpcio-reflection's own stubs for
the reflection protocol and nothing else: even the health check goes through reflection.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from waiting import wait_until

from weightclient import WeightClient

PROTO = Path(__file__).resolve().parents[2] / "protos" / "weightserver" / "v1" / "weights.proto"
WEIGHT_SERVICE = "weightserver.v1.WeightService"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"

# Run as `python -c GENERIC_CLIENT HOST:PORT`; prints one JSON object of what it saw.
GENERIC_CLIENT = r'''
import json
import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

channel = grpc.insecure_channel(sys.argv[1])
reflection = reflection_pb2_grpc.ServerReflectionStub(channel)


def reflect(**request):
    """One reflection request (list_services, file_containing_symbol, file_by_filename)."""
    requests = iter([reflection_pb2.ServerReflectionRequest(**request)])
    (response,) = reflection.ServerReflectionInfo(requests, timeout=10)
    if response.HasField("error_response"):
        raise RuntimeError(f"reflection {request}: {response.error_response.error_message}")
    return response


def file_descriptors(symbol):
    """The FileDescriptorProto defining `symbol` and every file it imports, by file name.
    Imports the server left out are asked for by file name, as grpcurl does."""
    files = {}

    def keep(response):
        for raw in response.file_descriptor_response.file_descriptor_proto:
            proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
            files.setdefault(proto.name, proto)

    keep(reflect(file_containing_symbol=symbol))
    while missing := sorted({d for f in list(files.values()) for d in f.dependency} - files.keys()):
        for name in missing:
            keep(reflect(file_by_filename=name))
    return files


# A fresh pool: not even google/protobuf/timestamp.proto is in it, so files go in imports first.
pool = descriptor_pool.DescriptorPool()
added = set()


def add_file(files, name):
    if name in added:
        return
    for dependency in files[name].dependency:
        add_file(files, dependency)
    pool.Add(files[name])
    added.add(name)


def load_service(name):
    files = file_descriptors(name)
    for file_name in files:
        add_file(files, file_name)
    return pool.FindServiceByName(name), sorted(files)


def call(service, method_name, request_json, metadata=()):
    """Call service/method with a request given as JSON, like `grpcurl -d`; returns the reply."""
    method = service.methods_by_name[method_name]
    request_class = message_factory.GetMessageClass(method.input_type)
    reply_class = message_factory.GetMessageClass(method.output_type)
    rpc = channel.unary_unary(
        f"/{service.full_name}/{method_name}",
        request_serializer=request_class.SerializeToString,
        response_deserializer=reply_class.FromString,
    )
    request = json_format.Parse(request_json, request_class())
    return rpc(request, timeout=10, metadata=metadata)


def as_json(message):
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


out = {}
listing = reflect(list_services="")
out["services"] = sorted(s.name for s in listing.list_services_response.service)

weights, out["weight_files"] = load_service("weightserver.v1.WeightService")
out["weight_file"] = weights.file.name
out["methods"] = {
    m.name: [m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming]
    for m in weights.methods
}

latest = call(weights, "GetLatest", '{"model": "policy"}')
out["get_latest_type"] = latest.DESCRIPTOR.full_name
out["get_latest"] = {
    "model": latest.model,
    "version": latest.version,
    "byte_size": latest.byte_size,
    "sha256": latest.sha256,
    "xxh3": latest.xxh3,
    "created_ns": latest.created.seconds * 10**9 + latest.created.nanos,
    "metadata": dict(latest.metadata),
    "tensors": [
        [t.name, t.dtype, list(t.shape), t.data_begin, t.data_end, t.xxh3] for t in latest.tensors
    ],
}
out["get_latest_json"] = as_json(latest)
out["list_models"] = as_json(call(weights, "ListModels", "{}"))

try:
    call(weights, "GetLatest", '{"model": "nonesuch"}')
    out["unknown_model"] = None
except grpc.RpcError as error:
    trailers = dict(error.trailing_metadata() or ())
    out["unknown_model"] = [error.code().name, trailers.get("weightserver-error")]

health, out["health_files"] = load_service("grpc.health.v1.Health")
out["health"] = {
    service: as_json(call(health, "Check", json.dumps({"service": service})))
    for service in ("", "weightserver.v1.WeightService")
}

# No generated stubs: nothing of the project was imported, and the default pool (where
# generated *_pb2 modules register their files) has never heard of the service.
out["project_modules"] = sorted(
    m for m in sys.modules if m.split(".")[0] in ("weightserver", "weightclient")
)
try:
    descriptor_pool.Default().FindServiceByName("weightserver.v1.WeightService")
    out["default_pool_has_service"] = True
except KeyError:
    out["default_pool_has_service"] = False
channel.close()
print(json.dumps(out))
'''


def run_generic_client(address: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", GENERIC_CLIENT, address], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def proto_rpcs() -> set[str]:
    """The rpc names that the public .proto declares."""
    return set(re.findall(r"^\s*rpc\s+(\w+)\s*\(", PROTO.read_text(), flags=re.MULTILINE))


def test_generic_client_lists_services_and_calls_through_reflection(server, client: WeightClient) -> None:
    assert client.publish({"w": torch.ones(3)}, model="policy") == 1
    assert client.publish({"w": torch.ones(3), "b": torch.zeros(2)}, model="policy", metadata={"step": "7"}) == 2
    assert client.publish({"q": torch.zeros(4, 2, dtype=torch.float16)}, model="critic") == 1
    wait_until(lambda: client.latest("policy").sha256 != "")  # computed after the commit
    expected = client.latest("policy")  # through the generated stubs, in this process

    seen = run_generic_client(server.address)

    # The generic client imported nothing of the project: no generated stubs were used.
    assert seen["project_modules"] == []
    assert seen["default_pool_has_service"] is False

    # Service listing: the weight service, health and reflection itself.
    assert {WEIGHT_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE} <= set(seen["services"])

    # The descriptors came over the wire, imports included, and describe every rpc of the .proto.
    assert seen["weight_file"] == "weightserver/v1/weights.proto"
    assert "google/protobuf/timestamp.proto" in seen["weight_files"]
    assert set(seen["methods"]) == proto_rpcs()
    assert seen["methods"]["GetLatest"] == [
        "weightserver.v1.GetLatestRequest",
        "weightserver.v1.VersionInfo",
        False,
        False,
    ]
    assert seen["methods"]["Publish"][2:] == [True, False]
    assert seen["methods"]["Fetch"][2:] == [False, True]

    # GetLatest with dynamic message classes: exactly what the stub-based client sees.
    assert seen["get_latest_type"] == "weightserver.v1.VersionInfo"
    latest = seen["get_latest"]
    assert latest["model"] == "policy"
    assert latest["version"] == 2
    assert latest["metadata"] == {"step": "7"}
    assert latest["byte_size"] == expected.byte_size
    assert latest["sha256"] == expected.sha256
    assert latest["xxh3"] == expected.xxh3
    assert abs(latest["created_ns"] / 1e9 - expected.created.timestamp()) < 2e-6  # datetime keeps microseconds
    assert latest["tensors"] == [[t.name, t.dtype, list(t.shape), t.begin, t.end, t.xxh3] for t in expected.tensors]
    assert sorted((name, dtype, tuple(shape)) for name, dtype, shape, *_ in latest["tensors"]) == [
        ("b", "F32", (2,)),
        ("w", "F32", (3,)),
    ]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t[5]) for t in latest["tensors"])

    # The JSON a tool like grpcurl prints (proto3 JSON mapping: 64-bit integers as strings,
    # the Timestamp as RFC 3339).
    as_json = seen["get_latest_json"]
    assert as_json["model"] == "policy"
    assert as_json["version"] == "2"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", as_json["created"])
    assert [t["name"] for t in as_json["tensors"]] == [t.name for t in expected.tensors]

    # ListModels the same way: sorted by name, with each model's latest version.
    models = seen["list_models"]["models"]
    assert [(m["model"], m["latest_version"], m["version_count"]) for m in models] == [
        ("critic", "1", 1),
        ("policy", "2", 2),
    ]
    assert all(int(m["retained_bytes"]) > 0 for m in models)

    # Errors reach a generic client as a status code plus the stable error name.
    assert seen["unknown_model"] == ["NOT_FOUND", "ModelNotFound"]

    # Health, called by name through reflection like `grpcurl ... grpc.health.v1.Health/Check`.
    assert seen["health"] == {"": {"status": "SERVING"}, WEIGHT_SERVICE: {"status": "SERVING"}}
    # (grpcio-health-checking names its file grpc_health/v1/health.proto rather than grpc/health/...)
    assert len(seen["health_files"]) == 1 and seen["health_files"][0].endswith("/v1/health.proto")
