"""The seed updater API over gRPC, with a real server and real modules (no torchrl needed)."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from waiting import wait_until

from weightclient import ServerUnavailable, WeightClient, tensor_parallel
from weightclient.torchrl.grpc_updaters import (
    GrpcLocalWeightUpdater,
    GrpcRemoteWeightUpdater,
    LocalWeightUpdaterBase,
    RemoteWeightUpdaterBase,
    Update,
)
from weightclient.torchrl.key_mapping import KeyMap
from weightclient.torchrl.publish_hook import PublishWeights, resolve_path


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


class CountingClient(WeightClient):
    """A real client that records what each fetch returned (None = nothing newer)."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.fetched: list[int | None] = []

    def fetch_bytes(self, model, **kwargs):
        result = super().fetch_bytes(model, **kwargs)
        self.fetched.append(None if result is None else result.info.version)
        return result


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka


def test_local_updater_pulls_only_newer_versions_in_place(server, client):
    trainer, policy = mlp(0), mlp(1)
    policy.share_memory()
    pointers = [p.data_ptr() for p in policy.parameters()]
    counting = CountingClient(server.address)
    updater = GrpcLocalWeightUpdater(counting, policy=policy)

    updater()  # nothing published yet: keeps its weights
    assert updater.version is None and counting.fetched == []

    client.publish(trainer, model="policy")
    updater()
    assert updater.version == 1 and updater.lag == 0
    assert_same_weights(policy, trainer)
    assert [p.data_ptr() for p in policy.parameters()] == pointers  # copied in place
    assert all(p.is_shared() for p in policy.parameters())

    updater()  # up to date: the server answers "nothing newer", no bytes move
    assert counting.fetched == [1, None]

    with torch.no_grad():
        trainer[0].weight.add_(1.0)
    client.publish(trainer, model="policy")
    client.publish(trainer, model="policy")
    assert updater.lag == 2
    updater()
    assert updater.version == 3 and updater.lag == 0
    assert counting.fetched == [1, None, 3]
    assert_same_weights(policy, trainer)


def test_local_updater_pinned_version(client):
    first, second, policy = mlp(0), mlp(1), mlp(2)
    client.publish(first, model="policy")
    client.publish(second, model="policy")
    updater = GrpcLocalWeightUpdater(client, policy=policy, version=1)
    updater()
    assert updater.version == 1 and updater.lag == 1
    assert_same_weights(policy, first)


def test_local_updater_key_map_and_mismatch_leaves_policy_untouched(client):
    trainer = mlp(0)
    client.publish({f"module.{k}": v for k, v in trainer.state_dict().items()}, model="policy")
    policy = mlp(1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    strict = GrpcLocalWeightUpdater(client, policy=policy)
    with pytest.raises(KeyError) as info:
        strict()
    assert "'policy' v1" in info.value.args[0] and "module.0.weight" in info.value.args[0]
    assert strict.version is None
    for key, value in policy.state_dict().items():
        assert torch.equal(value, before[key])

    mapped = GrpcLocalWeightUpdater(client, policy=policy, key_map=KeyMap(strip_prefix="module."))
    mapped()
    assert mapped.version == 1
    assert_same_weights(policy, trainer)


def test_local_updater_on_a_tensordict_module(client):
    trainer = mlp(0)
    client.publish(trainer, model="policy")
    policy = TensorDictModule(mlp(1), in_keys=["observation"], out_keys=["action"])
    GrpcLocalWeightUpdater(client, policy=policy, key_map=KeyMap(add_prefix="module."))()
    assert_same_weights(policy.module, trainer)


def test_collector_registration_once_by_weak_reference(client):
    class Holder:
        def __init__(self, policy):
            self.policy = policy

    trainer = mlp(0)
    client.publish(trainer, model="policy")
    holder = Holder(mlp(1))
    updater = GrpcLocalWeightUpdater(client)
    updater.register_collector(holder)
    assert updater.collector is holder
    with pytest.raises(RuntimeError, match="twice"):
        updater.register_collector(holder)
    updater.update_weights()  # uses the collector's policy
    assert_same_weights(holder.policy, trainer)
    del holder
    assert updater.collector is None


def test_updaters_pickle_without_their_channel(server, client):
    trainer, policy = mlp(0), mlp(1)
    client.publish(trainer, model="policy")
    local = GrpcLocalWeightUpdater(server.address, policy=policy)
    local()
    assert local.connected
    clone = pickle.loads(pickle.dumps(local))
    assert not clone.connected and clone.version == 1
    client.publish(mlp(5), model="policy")
    clone()  # reconnects lazily
    assert clone.version == 2
    remote = pickle.loads(pickle.dumps(GrpcRemoteWeightUpdater(server.address, trainer)))
    remote.update_weights()
    assert remote.version == 3


def test_an_updater_with_a_selection_pickles_and_applies_only_its_selection(server, client):
    """A collector's worker gets its updater pickled, selection and all: a glob's matcher pickled
    too (it was a closure, and the updater could not be sent)."""
    trainer = mlp(0)
    client.publish(trainer, model="policy")
    shapes = {"0.weight": (4, 3), "0.bias": (4,), "2.weight": (2, 8), "2.bias": (2,)}  # rank 1 of 2's shards
    policy = TensorDict({name: torch.zeros(shape) for name, shape in shapes.items()})
    local = GrpcLocalWeightUpdater(server.address, policy=policy, select=tensor_parallel(1, 2, {"0.*": 0}))
    clone = pickle.loads(pickle.dumps(local))
    clone()
    assert clone.version == 1
    held, published = clone.policy, trainer.state_dict()
    for name in ("0.weight", "0.bias"):
        assert torch.equal(held[name], published[name].chunk(2)[1])  # rank 1 of 2's half, along dim 0
    for name in ("2.weight", "2.bias"):
        assert torch.equal(held[name], published[name])  # no rule: whole (the plan's rest)


def test_remote_updater_worker_ids_map_to_models_and_publish_one_version(client):
    actor, critic = mlp(0), torch.nn.Linear(3, 1)
    updater = GrpcRemoteWeightUpdater(
        client,
        lambda: {"policy": actor, "critic": critic},
        models={0: "policy", 1: "policy", 2: "critic"},
    )
    assert updater.all_worker_ids() == [0, 1, 2]
    updater.update_weights()
    assert updater.version == 1  # workers 0 and 1 share "policy": published once, with critic
    assert client.latest("policy").group == ("policy", "critic")
    updater(worker_ids=2)
    assert updater.version == 2 and client.latest("critic").version == 2 and client.latest("policy").version == 1
    fetched = client.fetch("critic").state_dict()
    assert all(torch.equal(fetched[k], v) for k, v in critic.state_dict().items())


def test_remote_updater_max_interval_skips_like_the_ray_updater(client):
    updater = GrpcRemoteWeightUpdater(client, mlp(0), max_interval=2)
    versions = []
    for _ in range(7):
        updater.update_weights()
        versions.append(updater.version)
    assert versions == [None, None, 1, 1, 1, 2, 2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_updater_raises_after_retries_when_the_server_is_down(caplog):
    updater = GrpcRemoteWeightUpdater(f"127.0.0.1:{_closed_port()}", mlp(0), retries=2, backoff=0.01)
    with pytest.raises(ServerUnavailable):
        updater.update_weights()
    assert updater.version is None
    assert caplog.text.count("retry") == 2


def _client_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("weightclient")}


def test_remote_updater_close_flushes_and_closes_the_client_it_made(server):
    """Made from an address: close() lets a background publish in flight finish, then closes the
    client (it refuses calls; its threads end). Idempotent."""
    before = _client_threads()
    updater = GrpcRemoteWeightUpdater(server.address, mlp(0))
    assert updater.update_weights() == 1
    made = updater.client
    in_flight = made.publish(mlp(1), model="policy", wait=False)
    assert _client_threads() - before  # its background publisher
    updater.close()
    assert in_flight.done() and in_flight.result() == 2  # flushed, not dropped
    with pytest.raises(ValueError, match="closed channel"):
        made.publish(mlp(2), model="policy")
    wait_until(lambda: not _client_threads() - before, what="the client's threads to end")
    updater.close()  # again: nothing to do


def test_remote_updater_as_a_context_manager_closes_only_a_client_it_made(server, client):
    with GrpcRemoteWeightUpdater(client, mlp(0)) as given:
        assert given.update_weights() == 1
    assert client.publish(mlp(1), model="policy") == 2  # the caller's client stays open
    given.close()
    with GrpcRemoteWeightUpdater(server.address, mlp(0)) as made:
        assert made.update_weights() == 3
        its_client = made.client
    with pytest.raises(ValueError, match="closed channel"):
        its_client.latest("policy")
    assert client.latest("policy").version == 3


class FakeTrainer:
    """The two Trainer methods a hook uses, plus a loss module with two networks."""

    def __init__(self) -> None:
        self.loss_module = torch.nn.Module()
        self.loss_module.actor_network = mlp(0)
        self.loss_module.critic_network = torch.nn.Linear(3, 1)
        self.transforms = [torch.nn.Linear(2, 2)]
        self.ops: list[tuple[str, object]] = []
        self.modules: dict[str, object] = {}

    def register_op(self, dest: str, op) -> None:
        self.ops.append((dest, op))

    def register_module(self, name: str, module) -> None:
        self.modules[name] = module


def test_resolve_path():
    trainer = FakeTrainer()
    assert resolve_path(trainer, "loss_module.actor_network") is trainer.loss_module.actor_network
    assert resolve_path(trainer, "transforms[0]") is trainer.transforms[0]
    assert resolve_path(trainer, "loss_module.actor_network[2]") is trainer.loss_module.actor_network[2]
    with pytest.raises(AttributeError, match="no 'nope'"):
        resolve_path(trainer, "loss_module.nope")


def test_hook_with_weight_update_map_publishes_all_models_as_one_version_every_n(client):
    trainer = FakeTrainer()
    hook = PublishWeights(
        GrpcRemoteWeightUpdater(client, models=["policy", "critic"]),
        update_weights_interval=2,
        weight_update_map={"policy": "loss_module.actor_network", "critic": "loss_module.critic_network"},
    )
    hook.register(trainer)
    assert trainer.ops == [("post_steps", hook)] and trainer.modules == {"update_weights": hook}
    for _ in range(5):
        hook()
    assert hook.published == [1, 2]
    for model, module in (
        ("policy", trainer.loss_module.actor_network),
        ("critic", trainer.loss_module.critic_network),
    ):
        info = client.latest(model)
        assert info.version == 2 and info.group == ("policy", "critic")
        fetched = client.fetch(model).state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(fetched[key], value)


def test_hook_with_a_getter_and_a_plain_client(client):
    policy = mlp(0)
    hook = PublishWeights(client, update_weights_interval=1, policy_weights_getter=lambda: policy)
    hook()
    hook()
    assert hook.published == [1, 2] and client.latest("policy").version == 2
    assert hook.state_dict() == {"counter": 2, "last_update_count": 0}


def test_seed_classes_work_without_torchrl(server, client):
    client.publish(mlp(0), model="policy")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torchrl"] = None  # any import of torchrl now fails
        import torch
        from weightclient.torchrl.grpc_updaters import LocalWeightUpdaterBase, RemoteWeightUpdaterBase
        from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
        from weightclient.torchrl.publish_hook import PublishWeights
        torch.manual_seed(0)
        trainer = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        policy = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        updater = GrpcLocalWeightUpdater("{server.address}", policy=policy)
        updater()
        assert updater.version == 1
        assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), trainer.state_dict().values()))
        assert "torchrl" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_base_classes_are_abstract():
    with pytest.raises(TypeError):
        LocalWeightUpdaterBase()
    with pytest.raises(TypeError):
        RemoteWeightUpdaterBase()


def test_pull_returns_the_next_version_as_a_value_and_apply_writes_it(client):
    trainer, policy = mlp(0), mlp(1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    updater = GrpcLocalWeightUpdater(client, policy=policy, transport="stream")
    assert updater.pull() is None  # nothing published yet
    client.publish(trainer, model="policy")

    update = updater.pull()
    assert isinstance(update, Update) and update.version == 1 and not update.partial
    assert sorted(update.weights.keys()) == sorted(trainer.state_dict())  # the server's names
    assert update.stats.transport == "stream"
    assert updater.version is None  # pulled, not applied: the policy is untouched
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    updater.apply(update)
    assert updater.version == 1
    assert_same_weights(policy, trainer)
    assert updater.pull() is None  # up to date

    with torch.no_grad():
        trainer[2].bias.add_(1.0)
    client.publish(trainer, model="policy")
    delta = updater.pull()
    assert delta.partial and sorted(delta.weights.keys()) == ["2.bias"]
    assert delta.buffer is update.buffer  # the staging buffer, reused
    updater.apply(delta)
    assert updater.version == 2
    assert_same_weights(policy, trainer)


def test_a_key_map_rename_applies_a_delta_that_leaves_the_renamed_tensor_out(client):
    """A delta carries only the tensors that changed: one without the tensor a `KeyMap.rename` names
    applies (before, it raised KeyError "KeyMap.rename maps '0.weight' from 'W0', which the server
    weights lack" on every delta, and the policy stayed on the first version)."""
    trainer, policy = mlp(0), mlp(1)

    def published() -> dict[str, torch.Tensor]:
        return {"W0" if k == "0.weight" else k: v for k, v in trainer.state_dict().items()}

    client.publish(published(), model="policy")
    updater = GrpcLocalWeightUpdater(
        client, policy=policy, key_map=KeyMap(rename={"0.weight": "W0"}), transport="stream"
    )
    updater()
    assert updater.version == 1
    with torch.no_grad():
        trainer[2].bias.add_(1.0)
    client.publish(published(), model="policy")
    delta = updater.pull()
    assert delta.partial and sorted(delta.weights.keys()) == ["2.bias"]
    updater.apply(delta)
    assert updater.version == 2
    assert_same_weights(policy, trainer)
    with torch.no_grad():
        trainer[0].weight.add_(1.0)
    client.publish(published(), model="policy")
    updater()  # a delta that carries the renamed tensor
    assert updater.version == 3
    assert_same_weights(policy, trainer)


def test_a_second_pull_before_apply_does_not_overwrite_the_first(client):
    """A pulled Update holds the staging buffer until applied: a second pull receives into a
    buffer of its own, so the first update's weights stay intact."""
    policy = mlp(9)
    client.publish(mlp(1), model="policy")
    updater = GrpcLocalWeightUpdater(client, policy=policy, transport="stream", delta=False)
    updater.apply(updater.pull())  # the staging buffer now exists
    client.publish(mlp(2), model="policy")
    pending = updater.pull()
    client.publish(mlp(3), model="policy")
    newer = updater.pull()  # still newer than v1: v3
    assert (pending.version, newer.version) == (2, 3) and newer.buffer is not pending.buffer
    assert all(torch.equal(pending.weights[k], v) for k, v in mlp(2).state_dict().items())
    updater.apply(pending)
    assert updater.version == 2
    assert_same_weights(policy, mlp(2))
    updater.apply(newer)
    assert updater.version == 3
    assert_same_weights(policy, mlp(3))


@pytest.mark.parametrize("transport", ["auto", "bulk", "stream"])
def test_a_bad_override_is_refused_before_anything_is_written(client, transport):
    """An override that drops one key and adds another: KeyError naming both key sets, the
    policy's tensors and `version` untouched (once a version was applied)."""

    class Bad(GrpcLocalWeightUpdater):
        broken = False

        def _maybe_map_weights(self, server_weights, local_weights):
            mapped = dict(super()._maybe_map_weights(server_weights, local_weights).items())
            if self.broken:
                mapped["3.bias"] = mapped.pop("2.bias")
            return mapped

    policy = mlp(0)
    updater = Bad(client, policy=policy, transport=transport)
    client.publish(mlp(1), model="policy")
    updater()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    updater.broken = True
    client.publish(mlp(2), model="policy")
    with pytest.raises(KeyError) as info:
        updater()
    message = info.value.args[0]
    assert "missing (local keys the server weights of 'policy' v2 lack): ['2.bias']" in message
    assert "unexpected (server weights of 'policy' v2 keys with no local parameter): ['3.bias']" in message
    assert updater.version == 1
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())

    updater.broken = False
    updater()  # the same version, mapped properly, applies whole
    assert updater.version == 2
    assert_same_weights(policy, mlp(2))


def test_an_override_must_return_weights(client):
    class Declines(GrpcLocalWeightUpdater):
        def _maybe_map_weights(self, server_weights, local_weights):
            return None

    client.publish(mlp(0), model="policy")
    updater = Declines(client, policy=mlp(1))
    with pytest.raises(TypeError, match="_maybe_map_weights returned NoneType"):
        updater()
    assert updater.version is None


def test_explicit_weights_apply_strictly_and_leave_no_server_version(client):
    trainer, policy, other = mlp(0), mlp(1), mlp(2)
    client.publish(trainer, model="policy")
    updater = GrpcLocalWeightUpdater(client, policy=policy)
    updater()
    assert updater.version == 1
    with pytest.raises(KeyError, match="missing"):
        updater.load({k: v for k, v in other.state_dict().items() if k != "0.bias"})
    assert updater.version == 1 and updater.lag == 0
    assert_same_weights(policy, trainer)
    updater.load(other)  # keyed like the policy: no key map
    assert updater.version is None
    assert_same_weights(policy, other)
    updater()  # no server version held: the latest comes whole
    assert updater.version == 1
    assert_same_weights(policy, trainer)


def test_weights_given_to_update_weights_are_server_weights_through_the_hooks(client):
    policy, other = mlp(1), mlp(2)
    client.publish(mlp(0), model="policy")
    updater = GrpcLocalWeightUpdater(client, policy=policy, key_map=KeyMap(strip_prefix="module."))
    updater()
    updater.update_weights({f"module.{k}": v for k, v in other.state_dict().items()})  # the key map applies
    assert updater.version is None
    assert_same_weights(policy, other)
    with pytest.raises(KeyError, match="unexpected"):
        updater.update_weights(
            {**{f"module.{k}": v for k, v in mlp(3).state_dict().items()}, "module.9.w": torch.ones(1)}
        )
    assert_same_weights(policy, other)


class ServesItsOwn(GrpcLocalWeightUpdater):
    """`_get_server_weights` overridden as the seed's contract has it: server weights (a TensorDict,
    keyed as the server names them), here the weights of `served`."""

    served: torch.nn.Module | None = None
    calls = 0

    def _get_server_weights(self):
        self.calls += 1
        pulled = super()._get_server_weights()
        return None if pulled is None else TensorDict(dict(self.served.state_dict()), batch_size=[])


def test_a_get_server_weights_override_returning_server_weights_is_applied(client):
    """What an overridden `_get_server_weights` returns goes through the key map and the check and lands
    (before: AttributeError "'TensorDict' object has no attribute 'stats'" from apply)."""
    client.publish(mlp(1), model="policy")
    policy = TensorDictModule(mlp(0), in_keys=["observation"], out_keys=["action"])
    updater = ServesItsOwn(client, policy=policy, key_map=KeyMap(add_prefix="module."))
    updater.served = mlp(2)
    updater()
    assert updater.calls == 1 and updater.version is None  # no server version: weights of its own
    assert_same_weights(policy.module, mlp(2))


def test_the_sync_scheme_pulls_through_an_overridden_get_server_weights(client):
    """GrpcWeightSyncScheme(puller=...) honours the puller's `_get_server_weights` (before, it called
    pull() directly: the override never ran and the collector's policy got the server's version)."""
    pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")
    from torchrl_models import make_policy

    from tests.system.test_torchrl_integration import single_collector
    from weightclient.torchrl.scheme import GrpcWeightSyncScheme

    client.publish(make_policy(1).module, model="policy")
    policy = make_policy(0)
    puller = ServesItsOwn(client, key_map=KeyMap(add_prefix="module."))
    puller.served = make_policy(2).module
    collector = single_collector(policy, GrpcWeightSyncScheme(puller=puller))
    try:
        collector.update_policy_weights_()
        assert puller.calls == 1 and puller.version is None
        assert_same_weights(policy.module, make_policy(2).module)
    finally:
        collector.shutdown()


def test_remote_updater_runs_the_design_hooks_in_order_and_publishes_one_version(client):
    calls: list[str] = []

    class Recording(GrpcRemoteWeightUpdater):
        def _get_server_weights(self):
            calls.append("get")
            return super()._get_server_weights()

        def _maybe_map_weights(self, server_weights):
            calls.append("map")
            return {"policy": server_weights["actor"], "critic": server_weights["critic"]}

        def _skip_update(self, worker_id):
            calls.append(f"skip?{worker_id}")
            return super()._skip_update(worker_id)

        def _sync_weights_with_worker(self, worker_id, server_weights):
            calls.append(f"sync{worker_id}")
            super()._sync_weights_with_worker(worker_id, server_weights)

    actor, critic = mlp(0), torch.nn.Linear(3, 1)
    updater = Recording(client, lambda: {"actor": actor, "critic": critic}, models={0: "policy", 1: "critic"})
    assert updater.update_weights() == 1
    assert calls == ["get", "map", "skip?0", "sync0", "skip?1", "sync1"]
    assert client.latest("policy").group == ("policy", "critic") and client.latest("critic").version == 1
    fetched = client.fetch("critic").state_dict()
    assert all(torch.equal(fetched[k], v) for k, v in critic.state_dict().items())


@pytest.mark.parametrize("source", ["weight_update_map", "policy_weights_getter"])
def test_hook_goes_through_the_publishers_hooks_and_its_throttling(client, source):
    class Counting(GrpcRemoteWeightUpdater):
        mapped = 0

        def _maybe_map_weights(self, server_weights):
            self.mapped += 1
            return server_weights

    trainer = FakeTrainer()
    publisher = Counting(client, max_interval=2)
    if source == "weight_update_map":
        hook = PublishWeights(publisher, 1, weight_update_map={"policy": "loss_module.actor_network"}, trainer=trainer)
    else:
        hook = PublishWeights(publisher, 1, policy_weights_getter=lambda: trainer.loss_module.actor_network)
    for _ in range(6):
        hook()
    assert publisher.mapped == 6
    assert hook.published == [1, 2] and client.latest("policy").version == 2


def test_hook_arguments_are_checked(client):
    with pytest.raises(ValueError, match="interval_unit"):
        PublishWeights(client, 1, interval_unit="epochs")
    with pytest.raises(ValueError, match=r"models=\['critic', 'policy'\]"):
        PublishWeights(GrpcRemoteWeightUpdater(client), 1, weight_update_map={"policy": "a", "critic": "b"})
    hook = PublishWeights(GrpcRemoteWeightUpdater(client, mlp(0)), 1, interval_unit="optim_steps")
    with pytest.raises(RuntimeError, match="needs the trainer"):
        hook()
    fake = FakeTrainer()
    hook.register(fake)
    assert fake.ops == [("post_optim", hook)]
