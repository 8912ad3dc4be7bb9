"""Several models published under ONE version number, committed together."""

from __future__ import annotations

import threading

import pytest
import torch

from weightclient import InvalidRequest, VersionConflict, VersionEvicted, WeightClient
from weightserver.protocol.safetensors_format import build_header
from weightserver.storage.store import Upload, VersionStore


def payload(value: int) -> bytes:
    prefix, _ = build_header([("w", "U8", (4,), 4)])
    return prefix + bytes([value % 256] * 4)


def test_store_group_shares_one_version_above_every_member():
    store = VersionStore()
    for _ in range(4):
        store.publish("policy", payload(1))
    store.publish("critic", payload(2))
    records = store.publish_group([Upload("policy", payload(5)), Upload("critic", payload(6))])
    assert [(r.model, r.version) for r in records] == [("policy", 5), ("critic", 5)]
    assert all(r.group == ("policy", "critic") for r in records)
    assert store.latest("critic").version == 5 and store.latest("policy").version == 5


def test_store_group_is_all_or_nothing():
    store = VersionStore()
    store.publish_group([Upload("policy", payload(1)), Upload("critic", payload(1))])
    with pytest.raises(Exception, match="sha256"):
        store.publish_group([Upload("policy", payload(2)), Upload("critic", payload(2), sha256="0" * 64)])
    assert store.latest("policy").version == 1 and store.latest("critic").version == 1
    with pytest.raises(InvalidRequest, match="twice"):
        store.publish_group([Upload("policy", payload(2)), Upload("policy", payload(2))])
    with pytest.raises(VersionConflict):
        store.publish_group([Upload("policy", payload(2)), Upload("critic", payload(2))], version=1)


def test_torn_group_is_dropped_on_reload(tmp_path, caplog):
    store = VersionStore(tmp_path)
    store.publish_group([Upload("policy", payload(1)), Upload("critic", payload(1))])
    store.publish_group([Upload("policy", payload(2)), Upload("critic", payload(2))])
    # A crash after policy's manifest of v2 was written but before critic's.
    (tmp_path / "critic" / f"{2:012d}.json").unlink()
    reloaded = VersionStore(tmp_path)
    assert [v.version for v in reloaded.versions("policy")] == [1]
    assert [v.version for v in reloaded.versions("critic")] == [1]
    assert "did not complete before a crash" in caplog.text
    # The dropped number is never reused.
    assert reloaded.publish("policy", payload(3)).version == 3


def test_group_member_evicted_later_does_not_drop_the_rest(tmp_path):
    store = VersionStore(tmp_path, keep=1)
    store.publish_group([Upload("policy", payload(1)), Upload("critic", payload(1))])
    store.publish("policy", payload(2))  # evicts policy v1; critic v1 stays
    reloaded = VersionStore(tmp_path, keep=1)
    assert [v.version for v in reloaded.versions("critic")] == [1]
    assert [v.version for v in reloaded.versions("policy")] == [2]


def test_group_member_deleted_later_does_not_drop_the_rest(tmp_path, caplog):
    """A member's version deleted after the group committed left its partner's version without a
    match and with nothing newer: the reload took it for a torn group and removed its files (a
    committed version lost on restart). The member's high-water mark says the group completed."""
    store = VersionStore(tmp_path)
    store.publish_group([Upload("policy", payload(1)), Upload("critic", payload(1))])
    store.delete("critic", 1)
    reloaded = VersionStore(tmp_path)
    assert [v.version for v in reloaded.versions("policy")] == [1]
    assert "did not complete" not in caplog.text
    assert reloaded.publish("critic", payload(2)).version == 2


def test_client_group_publish_and_fetch_by_version(client: WeightClient):
    actor, critic = torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)
    version = client.publish_group({"policy": actor, "critic": critic}, metadata={"step": "7"})
    assert version == 1
    for name, module in (("policy", actor), ("critic", critic)):
        result = client.fetch(name, version=version)
        assert result.metadata == {"step": "7"}
        assert result.info.group == ("policy", "critic")
        for key, tensor in module.state_dict().items():
            assert torch.equal(result.state_dict()[key], tensor)
    assert client.latest("policy").group == ("policy", "critic")


def test_readers_never_see_policy_and_critic_from_different_publishes(server, client: WeightClient):
    """Each group publish fills both models with its version number; a reader that takes the
    policy's latest version and fetches the critic at that version always gets a match."""

    def weights(value: int) -> dict[str, dict[str, torch.Tensor]]:
        return {"policy": {"w": torch.full((64,), float(value))}, "critic": {"w": torch.full((8,), float(value))}}

    client.publish_group(weights(1))
    stop = threading.Event()
    problems: list[str] = []

    def reader():
        with WeightClient(server.address) as c:
            while not stop.is_set():
                policy = c.fetch("policy")
                try:
                    critic = c.fetch("critic", version=policy.version)
                except VersionEvicted:  # publishes outran this reader (keep=3): not a mix
                    continue
                for name, result in (("policy", policy), ("critic", critic)):
                    if not bool((result.state_dict()["w"] == policy.version).all()):
                        problems.append(f"{name} v{result.version} holds other values")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for value in range(2, 30):
            assert client.publish_group(weights(value)) == value
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not problems
