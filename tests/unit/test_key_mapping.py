"""KeyMap and the strict match between server weights and a local policy."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from weightclient.torchrl.key_mapping import IDENTITY, KeyMap, check_weights, map_keys


def apply_strict(server, local, key_map=IDENTITY, **options) -> TensorDict:
    """`server` mapped onto the keys of `local` and checked to match, as an updater does."""
    return check_weights(map_keys(server, key_map), local, **options)


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_ddp_prefix_is_stripped_once_onto_a_tensordict_module():
    # DDP(TensorDictModule(mlp)) on the trainer: "module.module.0.weight"; the collector's
    # TensorDictModule names it "module.0.weight". Only one "module." must go.
    trainer = mlp()
    server = {f"module.module.{k}": v for k, v in trainer.state_dict().items()}
    policy = TensorDictModule(mlp(), in_keys=["observation"], out_keys=["action"])
    mapped = apply_strict(server, TensorDict.from_module(policy), KeyMap(strip_prefix="module."))
    assert sorted(mapped.keys()) == sorted(policy.state_dict())
    assert torch.equal(mapped["module.0.weight"], trainer[0].weight)


def test_tensordict_module_prefix_is_added():
    trainer = mlp()
    policy = TensorDictModule(mlp(), in_keys=["observation"], out_keys=["action"])
    mapped = apply_strict(trainer.state_dict(), TensorDict.from_module(policy), KeyMap(add_prefix="module."))
    assert torch.equal(mapped["module.2.bias"], trainer[2].bias)


def test_trainer_path_is_selected_from_a_whole_loss_module():
    actor, critic = mlp(), torch.nn.Linear(3, 1)
    server = {f"loss_module.actor_network.{k}": v for k, v in actor.state_dict().items()}
    server.update({f"loss_module.critic_network.{k}": v for k, v in critic.state_dict().items()})
    mapped = apply_strict(server, TensorDict.from_module(mlp()), KeyMap(select="loss_module.actor_network."))
    assert sorted(mapped.keys()) == sorted(actor.state_dict())


def test_rename_and_callable():
    local = TensorDict.from_module(torch.nn.Linear(2, 2))
    server = {"W": torch.ones(2, 2), "B": torch.zeros(2)}
    mapped = apply_strict(server, local, KeyMap(rename={"weight": "W", "bias": "B"}))
    assert torch.equal(mapped["weight"], torch.ones(2, 2))
    mapped = apply_strict(server, local, lambda k: {"W": "weight", "B": "bias"}[k])
    assert torch.equal(mapped["bias"], torch.zeros(2))


def test_mismatch_lists_missing_unexpected_shape_and_dtype():
    local = TensorDict.from_module(mlp())
    server = dict(mlp().state_dict())
    del server["2.bias"]
    server["extra.weight"] = torch.zeros(1)
    server["0.weight"] = torch.zeros(5, 3)
    server["0.bias"] = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(KeyError) as info:
        apply_strict(server, local, source="server weights of 'policy' v3")
    message = info.value.args[0]  # str() of a KeyError adds quotes
    assert "missing (local keys the server weights of 'policy' v3 lack): ['2.bias']" in message
    assert "unexpected (server weights of 'policy' v3 keys with no local parameter): ['extra.weight']" in message
    assert "0.weight: server weights of 'policy' v3 (5, 3) vs local (4, 3)" in message
    assert "0.bias: server weights of 'policy' v3 torch.float64 vs local torch.float32" in message
    assert "nothing was updated" in message


def test_two_server_keys_onto_one_local_key_is_an_error():
    with pytest.raises(KeyError, match="both map to"):
        KeyMap(strip_prefix="module.").apply({"module.w": torch.zeros(1), "w": torch.zeros(1)})


def test_rename_of_a_missing_server_key_is_an_error():
    with pytest.raises(KeyError, match="lack"):
        KeyMap(rename={"weight": "nope"}).apply({"W": torch.zeros(1)})


def test_rename_of_a_server_key_a_delta_lacks_maps_the_rest():
    """A delta carries only the changed tensors: a rename whose server key it lacks is no error (before,
    KeyError "which the server weights lack"); one it carries still renames."""
    rename = KeyMap(rename={"weight": "W"})
    assert sorted(map_keys({"bias": torch.zeros(2)}, rename, partial=True).keys()) == ["bias"]
    assert sorted(map_keys({"W": torch.ones(2, 2)}, rename, partial=True).keys()) == ["weight"]
    with pytest.raises(KeyError, match="both map to"):  # as for a whole version
        KeyMap(rename={"weight": "W"}, fn=lambda k: "weight").apply({"V": torch.zeros(1)}, partial=True)


def test_map_keys_then_check_weights_a_delta_and_nested_weights():
    local = TensorDict.from_module(TensorDictModule(mlp(), in_keys=["observation"], out_keys=["action"]))
    delta = {"2.bias": torch.ones(2)}
    mapped = map_keys(delta, KeyMap(add_prefix="module."))
    assert sorted(mapped.keys()) == ["module.2.bias"]
    with pytest.raises(KeyError, match="missing"):
        check_weights(mapped, local)  # a whole version must cover every parameter
    checked = check_weights(mapped, local, partial=True)  # a delta need not
    assert torch.equal(checked["module.2.bias"], torch.ones(2))
    nested = {"module": {"2": {"bias": torch.ones(2)}}}  # what an override may return
    assert sorted(check_weights(nested, local, partial=True).keys()) == ["module.2.bias"]
    with pytest.raises(KeyError, match=r"unexpected .*\['module\.9\.bias'\]"):
        check_weights({"module.9.bias": torch.ones(2)}, local, partial=True)
