"""Version numbers stay in 1..2^63-1 (issue 14, item 2): a publish that asks for a larger one is
refused, a model that reached the largest one refuses the next publish with a clear message,
and a data dir that holds an out-of-range version (written before the bound existed) loads
without it. Every other model, and every later call, keeps being served, across restarts."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import grpc
import pytest

from weightserver.process import ServerProcess
from weightserver.protocol.errors import ERROR_METADATA_KEY
from weightserver.protocol.safetensors_format import build_header
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MAX_VERSION = 2**63 - 1
TIMEOUT = 30


def payload(n: int) -> bytes:
    prefix, _ = build_header([("w", "U32", (1,), 4)])
    return prefix + n.to_bytes(4, "little")


def publish(stub: pb_grpc.WeightServiceStub, model: str, data: bytes, version: int = 0) -> int:
    digest = hashlib.sha256(data).hexdigest()
    header = pb.PublishHeader(model=model, version=version, total_bytes=len(data), sha256=digest)
    messages = [pb.PublishRequest(header=header), pb.PublishRequest(chunk=data), pb.PublishRequest(commit={})]
    return stub.Publish(iter(messages), timeout=TIMEOUT).version.version


def refused(call, code: grpc.StatusCode, error: str, *fragments: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    assert dict(caught.value.trailing_metadata())[ERROR_METADATA_KEY] == error
    for fragment in fragments:
        assert fragment in caught.value.details()


def assert_served(stub: pb_grpc.WeightServiceStub, latest: dict[str, int]) -> None:
    """Every call answers for every model: the issue's failure was INTERNAL for all of them."""
    summaries = stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT).models
    assert {m.model: m.latest_version for m in summaries} == latest
    for model, version in latest.items():
        assert stub.GetLatest(pb.GetLatestRequest(model=model), timeout=TIMEOUT).version == version
        header = next(stub.Fetch(pb.FetchRequest(model=model), timeout=TIMEOUT)).header
        assert header.version == version
        listed = stub.ListVersions(pb.ListVersionsRequest(model=model), timeout=TIMEOUT).versions
        assert listed[-1].version == version


def test_a_version_over_2_63_is_refused_and_every_model_stays_served_across_restarts(tmp_path):
    data_dir = tmp_path / "data"
    server = ServerProcess("--data-dir", str(data_dir)).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            assert publish(stub, "other", payload(1)) == 1
            assert publish(stub, "policy", payload(1)) == 1
            for huge in (2**64 - 1, 2**63):
                refused(
                    lambda huge=huge: publish(stub, "policy", payload(2), version=huge),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "VersionTooLarge",
                    str(huge),
                    f"largest version number, {MAX_VERSION}",
                )
            assert publish(stub, "policy", payload(3)) == 2
            assert_served(stub, {"other": 1, "policy": 2})
        server.stop()
        assert sorted(p.name for p in (data_dir / "policy").iterdir()) == [
            f"{v:012d}{suffix}" for v in (1, 2) for suffix in (".json", ".safetensors")
        ]
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            assert_served(stub, {"other": 1, "policy": 2})
            # The largest number itself is allowed; nothing can follow it, and saying so
            # leaves the model (and every other) served.
            assert publish(stub, "policy", payload(4), version=MAX_VERSION) == MAX_VERSION
            refused(
                lambda: publish(stub, "policy", payload(5)),
                grpc.StatusCode.FAILED_PRECONDITION,
                "VersionConflict",
                f"latest version is {MAX_VERSION}",
                "another model name",
            )
            assert publish(stub, "other", payload(6)) == 2
            assert_served(stub, {"other": 2, "policy": MAX_VERSION})
        server.stop()
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            assert_served(pb_grpc.WeightServiceStub(channel), {"other": 2, "policy": MAX_VERSION})
    finally:
        server.kill()


def test_a_data_dir_holding_an_out_of_range_version_loads_without_it(tmp_path):
    """What the unbounded server left on disk (issue 14: v2^64 after v2^64-1) is skipped with a
    log line on start, not served; the model's next version follows its last valid one."""
    data_dir = tmp_path / "data"
    server = ServerProcess("--data-dir", str(data_dir)).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            assert publish(stub, "other", payload(1)) == 1
            assert publish(stub, "policy", payload(1)) == 1
        server.stop()
        model_dir = data_dir / "policy"
        for huge in (2**64 - 1, 2**64):
            _plant_version(model_dir, 1, huge)
        (model_dir / "high_water.json").write_text(json.dumps({"high_water": 2**64}))
        server.start()
        log = server.log()
        assert f"skipping {model_dir / f'{2**64:012d}.safetensors'}" in log
        assert f"over the largest version number, {MAX_VERSION}" in log
        assert "high_water.json" in log
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            assert_served(stub, {"other": 1, "policy": 1})
            assert publish(stub, "policy", payload(2)) == 2
            assert_served(stub, {"other": 1, "policy": 2})
    finally:
        server.kill()


def _plant_version(model_dir: Path, source: int, number: int) -> None:
    """Copy version `source` to `number`, manifest and all, as an unbounded server wrote it."""
    shutil.copy(model_dir / f"{source:012d}.safetensors", model_dir / f"{number:012d}.safetensors")
    manifest = json.loads((model_dir / f"{source:012d}.json").read_text())
    manifest["version"] = number
    (model_dir / f"{number:012d}.json").write_text(json.dumps(manifest))
