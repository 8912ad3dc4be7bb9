"""Issue 14 items 11 and 13: what a publisher's token may change, against real servers with a
token file.

A publish with pin=True pins its version, which PinVersion allows admins only: a publisher's
pinned publish used to succeed and pin (unbounded retention). A publisher or admin role may be
limited to some models (`publisher:policy`): it may publish, pin and delete only those.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import struct
from pathlib import Path

import grpc
import pytest
import torch

from weightclient import WeightClient
from weightserver.protocol.errors import ERROR_METADATA_KEY, InvalidRequest, ModelNotFound, PermissionDenied
from weightserver.service.auth import TokenTable
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
TOKENS = {
    "reader": ("reader", "r" * 24),
    "publisher": ("publisher", "p" * 24),
    "admin": ("admin", "a" * 24),
    "policy-publisher": ("publisher:policy", "q" * 24),
    "policy-admin": ("admin:policy,value", "b" * 24),
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


# ---------------------------------------------------------------------- item 13: model scopes
def test_a_model_scoped_publisher_may_publish_only_its_models_and_read_all(clients):
    assert clients["publisher"].publish(weights(), model="critic") == 1
    assert clients["policy-publisher"].publish(weights(), model=MODEL) == 1
    with pytest.raises(
        PermissionDenied, match=r"Publish of model 'critic': the token of 'policy-publisher' may change only policy"
    ):
        clients["policy-publisher"].publish(weights(9.0), model="critic")  # would evict critic's versions with --keep
    with pytest.raises(PermissionDenied, match="model 'critic'"):  # a group is all or nothing
        clients["policy-publisher"].publish_group({MODEL: weights(), "critic": weights()})
    assert clients["reader"].latest("critic").version == 1 and clients["reader"].latest(MODEL).version == 1
    # Reading is never scoped.
    assert torch.equal(clients["policy-publisher"].fetch("critic").tensors["w"], weights()["w"])
    assert [m.model for m in clients["policy-publisher"].list_models()] == ["critic", MODEL]


def test_a_model_scoped_admin_may_pin_and_delete_only_its_models(clients):
    for model in (MODEL, "critic"):
        clients["admin"].publish(weights(), model=model)
        clients["admin"].publish(weights(2.0), model=model)
    assert clients["policy-admin"].pin(MODEL, 1).pinned
    assert clients["policy-admin"].delete(MODEL, 2).version == 2
    assert clients["policy-admin"].publish(weights(3.0), model=MODEL, pin=True) == 3
    for change in (
        lambda c: c.pin("critic", 1),
        lambda c: c.delete("critic", 2),
        lambda c: c.publish(weights(), model="critic", pin=True),
    ):
        with pytest.raises(PermissionDenied, match="may change only policy, value"):
            change(clients["policy-admin"])
    assert [(v.version, v.pinned) for v in clients["reader"].list_versions("critic")] == [(1, False), (2, False)]


@pytest.mark.parametrize(
    ("role", "message"),
    [
        ("reader:policy", "a reader may read every model"),
        ("publisher:", "invalid model name ''"),
        ("admin:policy,../etc", "invalid model name '../etc'"),
        ("owner:policy", "unknown role 'owner'"),
    ],
)
def test_bad_model_scopes_in_a_token_file_are_refused_with_the_line(tmp_path, role, message):
    path = tmp_path / "tokens"
    path.write_text(f"{role} someone {'t' * 20}\n")
    with pytest.raises(InvalidRequest, match=message) as caught:
        TokenTable.load(path)
    assert str(path) in str(caught.value) and "t" * 20 not in str(caught.value)


def test_a_bad_model_scope_names_its_entry(tmp_path):
    """Of many entries, the one whose scope names a bad model is named, as a bad role or a short
    token is. Before, the message quoted only the model name (invalid model name ''), so which of
    the file's lines held it was left to guess."""
    path = tmp_path / "tokens"
    path.write_text(f"publisher:policy trainer-a {'a' * 20}\npublisher:policy, trainer-b {'b' * 20}\n")
    with pytest.raises(InvalidRequest, match=re.escape(f"{path}: token 'trainer-b': invalid model name ''")):
        TokenTable.load(path)


def raw_file() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0" * 4


def test_pickled_updaters_keep_the_token_of_the_client_they_were_given(server, clients):
    """A pickled updater (a collector's worker, a Ray actor) dials again in the new process, with the
    settings of the client it was given. Before, it dialled the address alone: on a server with
    tokens its first update failed with AuthenticationRequired."""
    from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater, GrpcRemoteWeightUpdater

    remote = pickle.loads(pickle.dumps(GrpcRemoteWeightUpdater(clients["publisher"], weights(2.0))))
    assert remote.update_weights() == 1
    policy = torch.nn.Module()
    policy.w = torch.nn.Parameter(torch.zeros(4))
    local = pickle.loads(pickle.dumps(GrpcLocalWeightUpdater(clients["reader"], policy=policy)))
    local()
    assert local.version == 1 and torch.equal(local.policy.w.detach(), weights(2.0)["w"])  # (its copy of the policy)
    local.close()
