"""PublishWeights: a trainer hook, modelled on torchrl.trainers.UpdateWeights, that publishes a
new version to the weight server every `update_weights_interval` batches."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from weightclient.client import WeightClient
from weightclient.grpc_updaters import GrpcRemoteWeightUpdater, Weights

_PATH_PART = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")


def resolve_path(root: Any, path: str) -> Any:
    """Follow ``"loss_module.actor_network"`` or ``"replay_buffer.transforms[0]"`` from `root`."""
    obj = root
    position = 0
    for match in _PATH_PART.finditer(path):
        if match.start() != position and path[position : match.start()] != ".":
            raise ValueError(f"cannot parse path {path!r} at {path[position:]!r}")
        name, index = match.groups()
        try:
            obj = getattr(obj, name) if name is not None else obj[int(index)]
        except (AttributeError, IndexError, KeyError, TypeError) as exc:
            step = name if name is not None else f"[{index}]"
            raise AttributeError(f"cannot resolve {path!r}: {type(obj).__name__} has no {step!r} ({exc})") from None
        position = match.end()
    if position != len(path) or not path:
        raise ValueError(f"cannot parse path {path!r}")
    return obj


class PublishWeights:
    """Publish the trainer's weights every `update_weights_interval` post-steps.

    Same arguments as ``torchrl.trainers.UpdateWeights`` with a publisher in place of the
    collector:

    * publisher: a `GrpcRemoteWeightUpdater` (retry policy, models) or a `WeightClient`.
    * policy_weights_getter: callable returning the weights to publish (to the publisher's
      model, "policy" by default).
    * weight_update_map: destination model name -> source path on the trainer, e.g.
      ``{"policy": "loss_module.actor_network", "critic": "loss_module.critic_network"}``;
      every entry is published under ONE version, committed together. Takes precedence over
      `policy_weights_getter`.
    * trainer: the Trainer the source paths start from (also set by `register`).

    Without either, the publisher publishes the weights it was built with.

    >>> hook = PublishWeights(updater, update_weights_interval=2,                    # doctest: +SKIP
    ...                       weight_update_map={"policy": "loss_module.actor_network"})
    >>> hook.register(trainer)                                                      # doctest: +SKIP
    """

    def __init__(
        self,
        publisher: GrpcRemoteWeightUpdater | WeightClient,
        update_weights_interval: int,
        policy_weights_getter: Callable[[], Weights] | None = None,
        weight_update_map: Mapping[str, str] | None = None,
        trainer: Any = None,
    ) -> None:
        if update_weights_interval < 1:
            raise ValueError(f"update_weights_interval must be >= 1, got {update_weights_interval}")
        if isinstance(publisher, WeightClient):
            publisher = GrpcRemoteWeightUpdater(publisher, policy_weights_getter)
        self.publisher = publisher
        self.update_weights_interval = update_weights_interval
        self.policy_weights_getter = policy_weights_getter
        self.weight_update_map = dict(weight_update_map or {})
        self.trainer = trainer
        self.counter = 0
        self.published: list[int] = []  # versions this hook published

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.counter += 1
        if self.counter % self.update_weights_interval == 0:
            self.publish()

    def publish(self) -> int | None:
        """Publish now (outside the interval); returns the new version."""
        if self.weight_update_map:
            if self.trainer is None:
                raise RuntimeError("weight_update_map needs the trainer: pass trainer= or call register(trainer)")
            weights = {dest: resolve_path(self.trainer, src) for dest, src in self.weight_update_map.items()}
            version = self.publisher.publish(weights)
        elif self.policy_weights_getter is not None:
            weights = self.policy_weights_getter()
            models = dict.fromkeys(self.publisher.models.values())
            version = self.publisher.publish(dict.fromkeys(models, weights))
        else:
            self.publisher.update_weights()
            version = self.publisher.version
        if version is not None:
            self.published.append(version)
        return version

    def register(self, trainer: Any, name: str = "update_weights") -> None:
        """Register at "post_steps" of a torchrl Trainer (and keep it for weight_update_map)."""
        self.trainer = trainer
        trainer.register_module(name, self)
        trainer.register_op("post_steps", self)

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counter = int(state["counter"])
