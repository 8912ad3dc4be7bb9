"""Issue 14 items 11 and 13: what a publisher's token may change, against real servers with a
token file.

A publish with pin=True pins its version, which PinVersion allows admins only: a publisher's
pinned publish used to succeed and pin (unbounded retention). A publisher or admin role may be
limited to some models (`publisher:policy`): it may publish, pin and delete only those.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import grpc
import pytest
import torch

from weightclient import WeightClient
from weightserver.errors import ERROR_METADATA_KEY, ModelNotFound, PermissionDenied
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
TOKENS = {
    "reader": ("reader", "r" * 24),
    "publisher": ("publisher", "p" * 24),
    "admin": ("admin", "a" * 24),
}


@pytest.fixture
def server(make_server, tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text("".join(f"{role}  {name}  {token}\n" for name, (role, token) in TOKENS.items()))
    return make_server(auth_tokens=path)


@pytest.fixture
def clients(server):
    opened = {name: WeightClient(server.address, token=token) for name, (_, token) in TOKENS.items()}
    yield opened
    for client in opened.values():
        client.close()


def weights(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


# ---------------------------------------------------------------------- item 11: pin=True
def test_a_publisher_cannot_pin_through_the_publish_header(server, clients):
    with pytest.raises(PermissionDenied, match=r"pin=True pins the version: PinVersion needs the 'admin' role"):
        clients["publisher"].publish(weights(), model=MODEL, pin=True)
    with pytest.raises(ModelNotFound):  # refused at the header: nothing was published
        clients["reader"].latest(MODEL)

    # The raw call: PERMISSION_DENIED with the error name, before any byte is sent.
    data = raw_file()
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), pin=True)
    metadata = (("authorization", f"Bearer {TOKENS['publisher'][1]}"),)
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.WeightServiceStub(channel).Publish(iter([pb.PublishRequest(header=header)]), metadata=metadata)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (ERROR_METADATA_KEY, "PermissionDenied") in tuple(caught.value.trailing_metadata())

    # Unpinned publishes stay the publisher's; an admin may publish pinned.
    assert clients["publisher"].publish(weights(), model=MODEL) == 1
    assert clients["admin"].publish(weights(2.0), model=MODEL, pin=True) == 2
    assert [(v.version, v.pinned) for v in clients["reader"].list_versions(MODEL)] == [(1, False), (2, True)]


def raw_file() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0" * 4
