"""Zero-copy apply on the server's host (issue 30): a collector's parameters become copy-on-write
views of a committed version's file instead of being copied into.

Real servers and gRPC, in this process (the server's host): a publish over the defaults goes to
shared memory, a `GrpcLocalWeightUpdater(watch=True)` naming no transport reads each announced
version's file with no call and swaps storage. Checked here: where the parameters point (the
address ranges of this process's mappings), whole-or-none when a hook fails, an evicted version
still readable, a collector's writes kept private, and the old version's mapping let go.
"""

from __future__ import annotations

import gc

import pytest
import torch
from mappings import version_mappings, views_a_version
from waiting import wait_until

from tests.integration.test_watching_updater import make_policy, same
from weightclient import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater

MODEL = "policy"


def following(updater: GrpcLocalWeightUpdater, version: int) -> None:
    """Once its Watch stream (opened by the update after the first) announced `version`."""
    updater()
    wait_until(lambda: updater.announced == version, what="the Watch stream")


def catch_up(updater: GrpcLocalWeightUpdater, version: int) -> None:
    wait_until(lambda: updater() or updater.version == version, what=f"the updater to apply v{version}")


@pytest.fixture
def publisher(make_server) -> WeightClient:
    server = make_server(keep=1)
    with WeightClient(server.address) as client:
        yield client


def follower(client: WeightClient, policy: torch.nn.Module, cls=GrpcLocalWeightUpdater) -> GrpcLocalWeightUpdater:
    """The documented defaults: no transport named, watching."""
    return cls(client.address, model=MODEL, policy=policy, watch=True)


def test_defaults_on_the_servers_host_map_each_version_and_swap_storage(publisher):
    trained, policy = make_policy(1), make_policy(0)
    assert publisher.publish(trained, model=MODEL) == 1  # no transport named
    updater = follower(publisher, policy)
    try:
        updater()
        assert updater.version == 1 and same(policy, trained)
        assert updater.last_fetch.transport == "shm" and updater.zero_copy
        assert all(views_a_version(p) for p in policy.parameters()), "the parameters were copied into"
        first = {name: p.data_ptr() for name, p in policy.named_parameters()}
        following(updater, 1)
        with torch.no_grad():
            trained[0].weight.add_(1.0)
        assert publisher.publish(trained, model=MODEL) == 2
        catch_up(updater, 2)
        assert same(policy, trained) and updater.zero_copy
        stats = updater.last_fetch
        assert stats.transport == "shm" and stats.direct, "the announced version was not read from its file"
        assert not stats.incoming, "cut-through on the server's host"
        assert all(p.data_ptr() != first[name] for name, p in policy.named_parameters())
        assert all(views_a_version(p) for p in policy.parameters())
        out = policy(torch.ones(3, 8))  # the policy runs on the mapped weights, with autograd intact
        out.sum().backward()
        assert all(p.grad is not None for p in policy.parameters())
    finally:
        updater.close()


def test_the_old_versions_mapping_is_let_go_after_the_swap(publisher):
    trained, policy = make_policy(1), make_policy(0)
    publisher.publish(trained, model=MODEL)
    updater = follower(publisher, policy)
    try:
        gc.collect()
        before = len(version_mappings())
        updater()
        gc.collect()
        assert len(version_mappings()) == before + 1
        held = [p.data_ptr() for p in policy.parameters()]
        for version in range(2, 6):
            with torch.no_grad():
                trained[2].bias.add_(1.0)
            assert publisher.publish(trained, model=MODEL) == version
            catch_up(updater, version)
            gc.collect()
            # The version applied is mapped; the one before is not: one version per collector.
            assert len(version_mappings()) == before + 1, version_mappings()
            assert not any(start <= ptr < end for ptr in held for start, end in version_mappings())
            held = [p.data_ptr() for p in policy.parameters()]
        assert same(policy, trained)
    finally:
        updater.close()


def test_an_evicted_version_stays_readable_where_it_is_mapped(publisher):
    """keep=1: v1's file leaves the server's folder at v2's commit; the collector still holding v1
    reads it whole, and moves on to v3 when it asks."""
    v1, policy = make_policy(1), make_policy(0)
    publisher.publish(v1, model=MODEL)
    updater = GrpcLocalWeightUpdater(publisher.address, model=MODEL, policy=policy)  # not watching
    try:
        updater()
        assert updater.zero_copy
        later = make_policy(7)
        assert publisher.publish(later, model=MODEL) == 2
        assert publisher.publish(later, model=MODEL) == 3
        assert [v.version for v in publisher.list_versions(MODEL)] == [3]  # v1 evicted
        gc.collect()
        assert same(policy, v1), "an evicted version changed under the collector"
        assert policy(torch.ones(2, 8)).shape == (2, 2)
        updater()
        assert updater.version == 3 and same(policy, later)
    finally:
        updater.close()


def test_a_collectors_writes_stay_its_own(publisher):
    """A collector that writes into its parameters (copy-on-write) changes neither the version's
    file nor what another collector or a network fetch gets."""
    trained = make_policy(1)
    publisher.publish(trained, model=MODEL)
    mine, theirs = make_policy(0), make_policy(0)
    writer, reader = follower(publisher, mine), follower(publisher, theirs)
    try:
        writer()
        assert writer.zero_copy
        with torch.no_grad():
            for p in mine.parameters():
                p.fill_(123.0)
        reader()
        assert reader.zero_copy and same(theirs, trained)
        assert all(torch.all(p == 123.0) for p in mine.parameters())
        fetched = publisher.fetch(MODEL, version=1, transport="stream")  # checked against the digest
        assert all(torch.equal(fetched.weights[k], v) for k, v in trained.state_dict().items())
    finally:
        writer.close()
        reader.close()


class FailsOnce(GrpcLocalWeightUpdater):
    """`_maybe_map_weights` raises for v2, or returns v2 with one tensor that cannot be written."""

    how = ""

    def _maybe_map_weights(self, server_weights, local_weights):
        mapped = super()._maybe_map_weights(server_weights, local_weights)
        if self.how == "raises":
            raise RuntimeError("a hook that fails")
        if self.how == "unwritable":
            mapped = dict(mapped.items())
            mapped["2.bias"] = torch.empty(2, device="meta")  # its copy fails, after the check
        return mapped


@pytest.mark.parametrize("how", ["raises", "unwritable"])
def test_a_failing_hook_leaves_the_policy_whole_on_the_version_it_held(publisher, how):
    trained, policy = make_policy(1), make_policy(0)
    publisher.publish(trained, model=MODEL)
    updater = follower(publisher, policy, FailsOnce)
    try:
        updater()
        assert updater.version == 1 and updater.zero_copy
        held = {name: p.data_ptr() for name, p in policy.named_parameters()}
        following(updater, 1)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(1.0)
        publisher.publish(trained, model=MODEL)
        updater.how = how
        wait_until(lambda: updater.announced == 2, what="the Watch stream")
        with pytest.raises((RuntimeError, NotImplementedError)):
            updater()
        # No parameter moved to v2: each still views v1's file, with v1's values.
        assert {name: p.data_ptr() for name, p in policy.named_parameters()} == held
        assert same(policy, make_policy(1))
        updater.how = ""
        updater()
        assert same(policy, trained)
    finally:
        updater.close()


def test_a_hook_that_makes_new_tensors_gets_a_copy(publisher):
    class Scales(GrpcLocalWeightUpdater):
        def _maybe_map_weights(self, server_weights, local_weights):
            return {k: v * 2 for k, v in super()._maybe_map_weights(server_weights, local_weights).items()}

    trained, policy = make_policy(1), make_policy(0)
    publisher.publish(trained, model=MODEL)
    updater = follower(publisher, policy, Scales)
    try:
        updater()
        assert updater.version == 1 and not updater.zero_copy
        assert not any(views_a_version(p) for p in policy.parameters())
        assert all(torch.equal(p, 2 * t) for p, t in zip(policy.parameters(), trained.parameters(), strict=True))
    finally:
        updater.close()


def test_parameters_in_shared_memory_are_copied_into(publisher):
    """torchrl's multi-process collectors keep a worker's parameters in shared memory: they stay
    there (one copy)."""
    trained, policy = make_policy(1), make_policy(0)
    policy.share_memory()
    publisher.publish(trained, model=MODEL)
    updater = follower(publisher, policy)
    try:
        shared = {name: p.data_ptr() for name, p in policy.named_parameters()}
        updater()
        assert updater.version == 1 and same(policy, trained) and not updater.zero_copy
        assert {name: p.data_ptr() for name, p in policy.named_parameters()} == shared
        assert all(p.is_shared() for p in policy.parameters())
    finally:
        updater.close()
