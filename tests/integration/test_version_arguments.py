"""A version number that no uint64 field holds (negative, 2**64 or more), given to any public client
method that takes one, is InvalidRequest naming the argument and the range 0..2**64-1 (what 0
means where it means something), raised by the call itself before anything is sent. Before, building
the request raised protobuf's bare ValueError ("Value out of range: -1"), not a WeightServerError;
a negative `version` got a message without the range, and `watch`, `watch_weights` and
`publish(wait=False)` raised nothing at the call. The server answers the next call as before: nothing was published,
deleted or pinned."""

from __future__ import annotations

import re

import pytest
import torch

from weightclient import InvalidRequest, WeightClient
from weightclient import tensors as tensor_codec
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater

MODEL = "policy"
WEIGHTS = {"w": torch.arange(4, dtype=torch.float32)}
BAD = [-1, -3, 2**64, 2**70]

# name -> (the argument the message names, the least number it takes, the call)
CALLS = {
    "fetch_bytes version": ("version", 1, lambda c, v: c.fetch_bytes(MODEL, version=v)),
    "fetch_bytes newer_than": ("newer_than", 0, lambda c, v: c.fetch_bytes(MODEL, newer_than=v)),
    "fetch_bytes base_version": ("base_version", 0, lambda c, v: c.fetch_bytes(MODEL, base_version=v)),
    "fetch version": ("version", 1, lambda c, v: c.fetch(MODEL, version=v)),
    "fetch newer_than": ("newer_than", 0, lambda c, v: c.fetch(MODEL, newer_than=v)),
    "fetch base": ("base", 0, lambda c, v: c.fetch(MODEL, base=v)),
    "describe": ("version", 0, lambda c, v: c.describe(MODEL, v)),
    "delete": ("version", 0, lambda c, v: c.delete(MODEL, v)),
    "pin": ("version", 0, lambda c, v: c.pin(MODEL, v)),
    "unpin": ("version", 0, lambda c, v: c.pin(MODEL, v, pinned=False)),
    "publish": ("version", 0, lambda c, v: c.publish(WEIGHTS, model=MODEL, version=v)),
    "publish wait=False": ("version", 0, lambda c, v: c.publish(WEIGHTS, model=MODEL, version=v, wait=False)),
    "publish_group": ("version", 0, lambda c, v: c.publish_group({MODEL: WEIGHTS}, version=v)),
    "publish_bytes": ("version", 0, lambda c, v: c.publish_bytes(MODEL, tensor_codec.encode(WEIGHTS), version=v)),
    "watch_weights": ("since", 0, lambda c, v: c.watch_weights(MODEL, since=v)),
    "watch": ("since", 0, lambda c, v: c.watch(MODEL, since=v)),
    "GrpcLocalWeightUpdater": ("version", 1, lambda c, v: GrpcLocalWeightUpdater(c, model=MODEL, version=v)),
}
EVERY_RETAINED = "0: every retained"
MEANING = {"describe": "0: the latest", "fetch newer_than": "0: any version", "GrpcLocalWeightUpdater": "None: follow"}
MEANING |= {"watch_weights": EVERY_RETAINED, "watch": EVERY_RETAINED}


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("call", CALLS)
def test_a_version_number_no_field_holds_is_invalid_request_naming_the_argument(server, client, call, value):
    first = client.publish(WEIGHTS, model=MODEL)
    name, least, method = CALLS[call]
    with pytest.raises(InvalidRequest) as refused:
        method(client, value)
    message = str(refused.value)
    assert re.search(rf"\b{name} must be a whole number from {least} to 2\*\*64-1\b", message), message
    assert f"got {value}" in message
    assert MEANING.get(call, "") in message
    # Nothing happened on the server, and it serves this client and a new one as before.
    assert [v.version for v in client.list_versions(MODEL)] == [first]
    assert not client.describe(MODEL, first).pinned
    with WeightClient(server.address) as other:
        assert torch.equal(other.fetch(MODEL).tensors["w"], WEIGHTS["w"])
    assert client.publish(WEIGHTS, model=MODEL) == first + 1
