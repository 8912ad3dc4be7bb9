"""The weight server with the REAL torchrl 0.14 collectors and Trainer.

The collector path is `GrpcWeightSyncScheme` for every collector kind. CI sets
WEIGHTSERVER_REQUIRE_TORCHRL=1, which turns a missing torchrl into a failure instead of the
skip below (see conftest.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import pytest
import torch

pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")

from mappings import version_mappings, views_a_version
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import ExplorationType
from torchrl.modules import ValueOperator
from torchrl.objectives import DDPGLoss, SoftUpdate
from torchrl.trainers import (
    DefaultOptimizationStepper,
    ReplayBufferTrainer,
    TargetNetUpdaterHook,
    Trainer,
    UpdateWeights,
)
from torchrl_models import PendulumQValue, actions_of, make_env, make_policy, make_two_head_policy
from waiting import wait_equal, wait_until

from weightclient import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater, GrpcRemoteWeightUpdater
from weightclient.torchrl.key_mapping import KeyMap
from weightclient.torchrl.publish_hook import PublishWeights
from weightclient.torchrl.scheme import GrpcWeightSyncScheme, ServerPolicyVersion

ATOL = 1e-5  # worker processes run other thread counts: actions differ in the last bits


def single_collector(policy, scheme, frames_per_batch=8, **kwargs) -> Collector:
    """A single-process Collector pulling through `scheme`, as docs/guides/torchrl.md shows it."""
    return Collector(
        make_env(),
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=ServerPolicyVersion(),
        exploration_type=ExplorationType.DETERMINISTIC,
        auto_register_policy_transforms=False,
        **kwargs,
    )


def catch_up(collector, scheme, batches, version: int, policy, seconds: float = 20.0) -> None:
    """Update before every batch until `scheme` applied `version`; the next batch is then
    stamped with it and acts as `policy` does."""

    def updated() -> int | None:
        collector.update_policy_weights_()
        next(batches)
        return scheme.version

    wait_equal(updated, version, timeout=seconds, what="the scheme's version")
    assert scheme.lag == 0
    batch = next(batches)
    assert batch["next", "policy_version"].unique().tolist() == [version]
    assert torch.allclose(batch["action"], actions_of(policy, batch), atol=ATOL)


def test_collector_pulls_through_our_scheme(client: WeightClient):
    collector_policy, trained = make_policy(0), make_policy(1)
    updater = GrpcWeightSyncScheme(client)
    collector = single_collector(collector_policy, updater)
    try:
        batches = iter(collector)
        first = next(batches)
        assert torch.allclose(first["action"], actions_of(make_policy(0), first), atol=ATOL)

        collector.update_policy_weights_()  # nothing published yet: no change, no error
        assert updater.version is None

        assert client.publish(trained, model="policy") == 1
        collector.update_policy_weights_()
        batch = next(batches)
        assert updater.version == 1 and updater.lag == 0
        assert torch.allclose(batch["action"], actions_of(trained, batch), atol=ATOL)
        assert not torch.allclose(batch["action"], actions_of(make_policy(0), batch), atol=ATOL)
        assert batch["next", "policy_version"].unique().tolist() == [1]

        collector.update_policy_weights_()  # up to date: version stays, nothing transferred
        assert next(batches)["next", "policy_version"].unique().tolist() == [1]
    finally:
        collector.shutdown()


class FailsWhenTold(GrpcLocalWeightUpdater):
    fail = False

    def _maybe_map_weights(self, server_weights, local_weights):
        if self.fail:
            raise RuntimeError("a hook that fails")
        return super()._maybe_map_weights(server_weights, local_weights)


def test_a_collector_on_the_servers_host_applies_versions_zero_copy(client: WeightClient):
    """The documented defaults in a real Collector on the server's host (issue 30): each version's
    file is mapped and the policy's parameters become views of it; the collector acts on it; a
    write into the policy stays the collector's own; the version before is let go; a hook that
    fails leaves the policy whole on the version it held."""
    policy = make_policy(0)
    puller = FailsWhenTold(client.address, watch=True)
    scheme = GrpcWeightSyncScheme(puller=puller)
    collector = single_collector(policy, scheme)
    try:
        batches = iter(collector)
        before = len(version_mappings())
        for version, seed in ((1, 1), (2, 2), (3, 3)):
            trained = make_policy(seed)
            assert client.publish(trained, model="policy") == version
            catch_up(collector, scheme, batches, version, trained)
            assert puller.zero_copy and puller.last_fetch.transport == "shm"
            assert all(views_a_version(p) for p in policy.parameters())
            assert len(version_mappings()) == before + 1, "more than the version applied is mapped"
        with torch.no_grad():
            next(policy.parameters()).add_(1.0)  # the collector's own page copies
        served = client.fetch("policy", version=3, transport="stream").weights  # checked against its digest
        assert all(torch.equal(served[k], v) for k, v in trained.state_dict().items())
        held = {name: p.data_ptr() for name, p in policy.named_parameters()}
        puller.fail = True
        assert client.publish(make_policy(4), model="policy") == 4
        wait_until(lambda: puller.announced == 4, what="v4's announcement")
        with pytest.raises(RuntimeError, match="a hook that fails"):
            collector.update_policy_weights_()
        assert scheme.version == 3 and {name: p.data_ptr() for name, p in policy.named_parameters()} == held
    finally:
        collector.shutdown()


def test_a_watching_updater_applies_announced_versions_in_a_real_collector(client: WeightClient):
    """watch=True: between announcements update_policy_weights_() asks nothing (see
    test_watching_updater.py); an announced version reaches the next batch as usual."""
    scheme = GrpcWeightSyncScheme(client, watch=True)
    collector = single_collector(make_policy(0), scheme)

    def announced(version: int) -> bool:  # while following, lag comes from the announcements
        return scheme.puller.following and scheme.version is not None and scheme.version + scheme.lag == version

    try:
        batches = iter(collector)
        next(batches)
        assert client.publish(make_policy(1), model="policy") == 1
        collector.update_policy_weights_()  # nothing applied yet: it asks
        assert scheme.version == 1
        collector.update_policy_weights_()  # starts following from v1
        wait_until(lambda: announced(1), step=0.01)
        trained = make_policy(2)
        assert client.publish(trained, model="policy") == 2
        wait_until(lambda: announced(2), step=0.01)
        collector.update_policy_weights_()
        batch = next(batches)
        assert scheme.version == 2
        assert torch.allclose(batch["action"], actions_of(trained, batch), atol=ATOL)
        assert batch["next", "policy_version"].unique().tolist() == [2]
    finally:
        collector.shutdown()


def test_plain_policy_version_tracker_also_reads_the_server_version(client: WeightClient):
    collector = Collector(
        make_env(),
        make_policy(0),
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": GrpcWeightSyncScheme(client)},
        track_policy_version=True,
        auto_register_policy_transforms=False,
    )
    try:
        batches = iter(collector)
        for _ in range(3):
            client.publish(make_policy(1), model="policy")
        collector.update_policy_weights_()
        collector.update_policy_weights_()  # nothing newer: the version must not drift
        assert next(batches)["next", "policy_version"].unique().tolist() == [3]
    finally:
        collector.shutdown()


def test_torchrl_update_weights_hook_drives_our_scheme(client: WeightClient):
    """torchrl's own UpdateWeights(collector, N, policy_weights_getter=...) on a collector
    whose scheme is ours: a getter returning None makes the collector pull from the server."""
    trained = make_policy(1)
    client.publish(trained, model="policy")
    collector = single_collector(make_policy(0), GrpcWeightSyncScheme(client))
    try:
        hook = UpdateWeights(collector, 2, policy_weights_getter=lambda: None)
        batches = iter(collector)
        hook()  # 1st post-step: not yet
        assert next(batches)["next", "policy_version"].unique().tolist() == [0]
        hook()  # 2nd: pulls v1
        batch = next(batches)
        assert batch["next", "policy_version"].unique().tolist() == [1]
        assert torch.allclose(batch["action"], actions_of(trained, batch), atol=ATOL)
    finally:
        collector.shutdown()


def test_key_map_from_a_trainer_path(client: WeightClient):
    """The trainer published its whole loss module; the collector selects the actor."""
    trained = make_policy(3)
    published = {f"loss_module.actor_network.{k}": v for k, v in trained.state_dict().items()}
    published["loss_module.critic.w"] = torch.zeros(3)
    client.publish(published, model="policy")
    scheme = GrpcWeightSyncScheme(client, key_map=KeyMap(select="loss_module.actor_network."))
    collector = single_collector(make_policy(0), scheme)
    try:
        collector.update_policy_weights_()
        batch = next(iter(collector))
        assert torch.allclose(batch["action"], actions_of(trained, batch), atol=ATOL)
    finally:
        collector.shutdown()


def test_mismatched_weights_raise_and_leave_the_collector_policy_alone(client: WeightClient):
    client.publish(make_policy(1).module, model="policy")  # "mlp.0.weight", not "module.mlp.0.weight"
    policy = make_policy(0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    collector = single_collector(policy, GrpcWeightSyncScheme(client))
    try:
        with pytest.raises(KeyError) as info:
            collector.update_policy_weights_()
        assert "module.mlp.0.weight" in info.value.args[0] and "KeyMap" in info.value.args[0]
        assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    finally:
        collector.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_multiprocess_collectors_pull_through_the_sync_scheme(client: WeightClient, collector_class):
    scheme = GrpcWeightSyncScheme(client)
    collector = collector_class(
        [make_env, make_env],
        make_policy(0),
        frames_per_batch=16,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
        exploration_type=ExplorationType.DETERMINISTIC,
        auto_register_policy_transforms=False,
    )
    try:
        batches = iter(collector)
        next(batches)
        for version, seed in ((1, 1), (2, 2)):
            trained = make_policy(seed)
            assert client.publish(trained, model="policy") == version
            collector.update_policy_weights_()
            assert scheme.version == version and scheme.lag == 0
            # MultiSync is exact: the next batch is all new weights. MultiAsync applies them
            # while rollouts run: within a few batches every frame is new.
            for _ in range(1 if collector_class is MultiSyncCollector else 6):
                batch = next(batches)
                versions = batch["next", "policy_version"].unique().tolist()
                if versions == [version]:
                    break
            assert versions == [version]
            assert torch.allclose(batch["action"], actions_of(trained, batch), atol=ATOL)
        collector.update_policy_weights_()  # up to date: nothing sent to the workers
        assert scheme.version == 2
    finally:
        collector.shutdown()


def test_sync_scheme_pickles_without_a_channel(client: WeightClient):
    import pickle
    from multiprocessing.reduction import ForkingPickler

    scheme = GrpcWeightSyncScheme(client, key_map=lambda k: k)  # a lambda and a live channel
    scheme.puller.client.latest  # noqa: B018 - the channel exists
    clone = pickle.loads(ForkingPickler.dumps(scheme))  # as multiprocessing sends it to a worker
    assert clone.puller is None and clone.version is None  # workers never dial the server


def build_trainer(collector_policy, actor, server_address, total_batches):
    critic = ValueOperator(PendulumQValue(), in_keys=["th", "thdot", "action"])
    loss = DDPGLoss(actor_network=actor, value_network=critic)
    scheme = GrpcWeightSyncScheme(server_address)
    collector = single_collector(collector_policy, scheme, frames_per_batch=32)
    trainer = Trainer(
        collector=collector,
        total_frames=32 * total_batches,
        frame_skip=1,
        optim_steps_per_batch=4,
        loss_module=loss,
        optimizer=torch.optim.Adam(loss.parameters(), lr=1e-3),
        optimization_stepper=DefaultOptimizationStepper(),
        progress_bar=False,
    )
    buffer = ReplayBufferTrainer(
        ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=64), flatten_tensordicts=True
    )
    trainer.register_op("batch_process", buffer.extend)
    trainer.register_op("process_optim_batch", buffer.sample)
    trainer.register_module("replay_buffer", buffer)
    trainer.register_op("post_optim", TargetNetUpdaterHook(SoftUpdate(loss, tau=0.05)))
    return trainer, collector, scheme


@pytest.mark.parametrize("publisher", ["PublishWeights", "torchrl UpdateWeights(sender=)"])
def test_trainer_publishes_and_collector_pulls(server, client: WeightClient, publisher):
    """A real Trainer: DDPG on PendulumEnv, a few dozen optimisation steps. The trainer's actor
    and the collector's policy are different objects: weights reach the collector only through
    the server. Every 2 batches a version is published; the collector pulls before each batch."""
    actor, collector_policy = make_policy(0), make_policy(0)
    client.publish(actor, model="policy")  # version 1: what the collector starts from
    trainer, collector, scheme = build_trainer(collector_policy, actor, server.address, total_batches=10)

    sender = GrpcRemoteWeightUpdater(server.address, actor)
    if publisher == "PublishWeights":
        PublishWeights(sender, 2, weight_update_map={"policy": "loss_module.actor_network"}).register(trainer)
    else:
        UpdateWeights(sender=sender, update_weights_interval=2).register(trainer)
    UpdateWeights(collector, 1, policy_weights_getter=lambda: None).register(trainer, name="pull_weights")

    seen: list[list[int]] = []
    lags: list[int] = []
    trainer.register_op("batch_process", lambda batch: seen.append(batch["next", "policy_version"].unique().tolist()))
    trainer.register_op("post_steps", lambda: lags.append(scheme.lag))
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    trainer.train()

    assert trainer._optim_count == 40
    latest = client.latest("policy").version
    assert latest == 1 + 10 // 2  # published every 2 batches
    assert seen[0] == [0]  # before the first pull the collector ran its own initial weights
    assert all(len(v) == 1 for v in seen), seen  # one server version per batch
    versions = [v[0] for v in seen[1:]]
    assert versions == sorted(versions) and versions[-1] == latest - 1 and versions[0] >= 1
    assert lags == [0] * 10  # the pull hook runs after the publish hook: the collector is never behind
    # the weights really travelled: the trainer's actor changed and the server holds it
    assert any(not torch.equal(v, initial[k]) for k, v in actor.state_dict().items())
    fetched = client.fetch("policy").state_dict()
    assert all(torch.equal(fetched[k], v) for k, v in actor.state_dict().items())
    assert isinstance(client.fetch("policy").weights, TensorDict)


def test_the_documented_usage_draws_no_deprecation_warning(server, client: WeightClient):
    """docs/guides/torchrl.md's collector (a GrpcWeightSyncScheme) and trainer hook (PublishWeights): no
    DeprecationWarning from torchrl or from us, recorded here whatever the pytest settings."""
    actor = make_policy(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheme = GrpcWeightSyncScheme(server.address)
        collector = single_collector(make_policy(0), scheme)
        try:
            PublishWeights(GrpcRemoteWeightUpdater(server.address, actor), 1).publish()
            collector.update_policy_weights_()
            batch = next(iter(collector))
        finally:
            collector.shutdown()
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert deprecations == []
    assert scheme.version == 1 and batch["next", "policy_version"].unique().tolist() == [1]
    assert torch.allclose(batch["action"], actions_of(actor, batch), atol=ATOL)


class SwapHeads(GrpcLocalWeightUpdater):
    """The server's head_a lands in the policy's head_b and the other way round; records the
    server keys it was given."""

    SWAP = {"module.head_a.": "module.head_b.", "module.head_b.": "module.head_a."}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[list[str]] = []

    def _maybe_map_weights(self, server_weights, local_weights):
        mapped = super()._maybe_map_weights(server_weights, local_weights)
        self.given.append(sorted(mapped.keys()))
        swapped = {}
        for key, tensor in mapped.items():
            prefix = next((p for p in self.SWAP if key.startswith(p)), None)
            swapped[self.SWAP[prefix] + key[len(prefix) :] if prefix else key] = tensor
        return swapped


def swapped_state(policy) -> dict[str, torch.Tensor]:
    """What a SwapHeads updater makes of `policy`'s weights."""
    return {
        next((SwapHeads.SWAP[p] + k[len(p) :] for p in SwapHeads.SWAP if k.startswith(p)), k): v.clone()
        for k, v in policy.state_dict().items()
    }


def assert_state_is(policy, expected: dict[str, torch.Tensor]) -> None:
    state = policy.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


@pytest.mark.parametrize("transport", ["auto", "shm", "bulk", "stream"])
def test_a_maybe_map_weights_override_is_what_lands_on_every_transport(client: WeightClient, transport):
    """A GrpcLocalWeightUpdater subclass swapping two same-shaped heads, in a real Collector:
    the live policy holds the swapped weights bit for bit, for a whole version and for a
    delta, whatever the transport. Over shared memory (here, the server's host, where "auto"
    picks it) every version comes whole and lands zero-copy: each head's parameters become views
    of the other head's tensors in the version's file."""
    trained, policy = make_two_head_policy(1), make_two_head_policy(0)
    swapper = SwapHeads(client, transport=transport)
    adapter = GrpcWeightSyncScheme(puller=swapper)
    collector = single_collector(policy, adapter)
    try:
        assert client.publish(trained, model="policy") == 1
        collector.update_policy_weights_()
        assert adapter.version == 1
        mapped = transport in ("auto", "shm")
        assert swapper.last_fetch.transport == ("shm" if mapped else transport)
        assert swapper.zero_copy == mapped
        assert_state_is(policy, swapped_state(trained))
        batch = next(iter(collector))
        expected_policy = make_two_head_policy(9)
        expected_policy.load_state_dict(swapped_state(trained))
        assert torch.allclose(batch["action"], actions_of(expected_policy, batch), atol=ATOL)

        with torch.no_grad():
            trained.module.head_a.weight.add_(0.5)  # v2 differs in one tensor: a delta
        assert client.publish(trained, model="policy") == 2
        collector.update_policy_weights_()
        if mapped:  # the whole version, mapped: nothing to gain from a delta
            assert swapper.given[-1] == swapper.given[0] and swapper.zero_copy
        else:
            assert swapper.given[-1] == ["module.head_a.weight"]  # the delta, before mapping
        assert adapter.version == 2
        assert_state_is(policy, swapped_state(trained))
        batch = next(iter(collector))
        expected_policy.load_state_dict(swapped_state(trained))
        assert torch.allclose(batch["action"], actions_of(expected_policy, batch), atol=ATOL)
    finally:
        collector.shutdown()


class DropsOneAddsOne(GrpcLocalWeightUpdater):
    """Once `broken`, maps head_b's bias to a key the policy does not have."""

    broken = False

    def _maybe_map_weights(self, server_weights, local_weights):
        mapped = dict(super()._maybe_map_weights(server_weights, local_weights).items())
        if self.broken:
            mapped["module.head_c.bias"] = mapped.pop("module.head_b.bias")
        return mapped


@pytest.mark.parametrize("transport", ["auto", "bulk", "stream"])
def test_a_bad_override_raises_naming_both_key_sets_and_changes_nothing(client: WeightClient, transport):
    policy = make_two_head_policy(0)
    bad = DropsOneAddsOne(client, transport=transport, delta=False)
    scheme = GrpcWeightSyncScheme(puller=bad)
    collector = single_collector(policy, scheme)
    try:
        v1 = make_two_head_policy(1)
        client.publish(v1, model="policy")
        collector.update_policy_weights_()
        assert scheme.version == 1
        before = {k: v.clone() for k, v in policy.state_dict().items()}

        bad.broken = True
        client.publish(make_two_head_policy(2), model="policy")
        with pytest.raises(KeyError) as info:
            collector.update_policy_weights_()
        message = info.value.args[0]
        assert "missing (local keys the server weights of 'policy' v2 lack): ['module.head_b.bias']" in message
        assert "unexpected (server weights of 'policy' v2 keys with no local parameter): ['module.head_c.bias']" in (
            message
        )
        assert scheme.version == 1
        assert_state_is(policy, before)
        batch = next(iter(collector))
        assert batch["next", "policy_version"].unique().tolist() == [1]
        assert torch.allclose(batch["action"], actions_of(v1, batch), atol=ATOL)
    finally:
        collector.shutdown()


class ActorOutOfLossModule(GrpcRemoteWeightUpdater):
    """Given the trainer's whole loss module, publishes only its actor; counts its calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mapped = 0

    def _maybe_map_weights(self, server_weights):
        self.mapped += 1
        loss = server_weights["policy"] if isinstance(server_weights, Mapping) else server_weights
        return {"policy": loss.actor_network}


@pytest.mark.parametrize("source", ["weight_update_map", "policy_weights_getter"])
def test_publish_weights_runs_the_remote_updaters_hooks_on_a_real_trainer(server, client: WeightClient, source):
    """PublishWeights with weight_update_map or policy_weights_getter: the publisher's
    `_maybe_map_weights` runs on every call and its `max_interval` throttles (6 batches,
    max_interval=2: 2 versions); what the override returns is what the server holds."""
    actor = make_policy(0)
    client.publish(actor, model="policy")
    trainer, collector, _ = build_trainer(make_policy(0), actor, server.address, total_batches=6)
    sender = ActorOutOfLossModule(server.address, max_interval=2)
    if source == "weight_update_map":
        hook = PublishWeights(sender, 1, weight_update_map={"policy": "loss_module"})
    else:
        hook = PublishWeights(sender, 1, policy_weights_getter=lambda: trainer.loss_module)
    hook.register(trainer)
    UpdateWeights(collector, 1, policy_weights_getter=lambda: None).register(trainer, name="pull_weights")
    trainer.train()

    assert sender.mapped == 6
    assert hook.published == [2, 3] and client.latest("policy").version == 3
    fetched = client.fetch("policy").state_dict()
    assert sorted(fetched) == sorted(actor.state_dict())  # the actor alone, not the loss module
    assert all(torch.equal(fetched[k], v) for k, v in actor.state_dict().items())


def test_publish_weights_every_n_optimizer_steps_on_a_real_trainer(server, client: WeightClient):
    """interval_unit="optim_steps": registered at "post_optim", a version every 3 optimizer
    steps (20 steps in 5 batches: 6 versions, some in the middle of a batch's optimization)."""
    actor = make_policy(0)
    client.publish(actor, model="policy")
    trainer, collector, scheme = build_trainer(make_policy(0), actor, server.address, total_batches=5)
    sender = GrpcRemoteWeightUpdater(server.address)
    hook = PublishWeights(
        sender, 3, weight_update_map={"policy": "loss_module.actor_network"}, interval_unit="optim_steps"
    )
    hook.register(trainer)
    UpdateWeights(collector, 1, policy_weights_getter=lambda: None).register(trainer, name="pull_weights")
    after_each_step: list[int | None] = []
    trainer.register_op("post_optim", lambda: after_each_step.append(sender.version))
    trainer.train()

    assert trainer._optim_count == 20  # DefaultOptimizationStepper keeps no count of its own
    assert after_each_step == [1 + step // 3 if step >= 3 else None for step in range(1, 21)]
    assert hook.published == [2, 3, 4, 5, 6, 7] and client.latest("policy").version == 7
    assert hook.state_dict() == {"counter": 0, "last_update_count": 18}
    assert scheme.version == 7  # the collector pulled after the last batch's publishes
    fetched = client.fetch("policy").state_dict()
    assert any(not torch.equal(fetched[k], v) for k, v in actor.state_dict().items())  # 2 steps after v7


def test_puller_is_the_whole_updater(client: WeightClient):
    with pytest.raises(ValueError, match="pass client, key_map to GrpcLocalWeightUpdater"):
        GrpcWeightSyncScheme(client, key_map=KeyMap(add_prefix="module."), puller=SwapHeads(client))
    with pytest.raises(ValueError, match="pass transport"):
        GrpcWeightSyncScheme(transport="bulk", puller=SwapHeads(client))
