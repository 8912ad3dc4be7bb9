"""PublishWeights: a trainer hook, modelled on torchrl.trainers.UpdateWeights, that publishes a
new version to the weight server every `update_weights_interval` batches or optimizer steps,
through a `GrpcRemoteWeightUpdater`'s hooks."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from weightclient.client import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcRemoteWeightUpdater, Weights

INTERVAL_UNITS = ("batches", "optim_steps")
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
    """Publish the trainer's weights every `update_weights_interval` batches or optimizer steps.

    The arguments are ``torchrl.trainers.UpdateWeights``' with a publisher in place of the
    collector: a `GrpcRemoteWeightUpdater` (or a `WeightClient`, wrapped in one).
    `weight_update_map` maps each of the publisher's model names to a source path on the
    trainer (``{"policy": "loss_module.actor_network"}``); its entries are published under ONE
    version and take precedence over `policy_weights_getter`. `interval_unit="batches"` counts
    calls at ``"post_steps"``; ``"optim_steps"`` counts the trainer's optimizer steps and
    `register` puts the hook at ``"post_optim"``, as ``UpdateWeights`` does.

    Every publish is the publisher's ``update_weights()``, so its hooks run. `published` lists
    the versions this hook published.

    >>> hook = PublishWeights(updater, update_weights_interval=2,                    # doctest: +SKIP
    ...                       weight_update_map={"policy": "loss_module.actor_network"})
    >>> hook.register(trainer)                                                      # doctest: +SKIP
    """

    def __init__(
        self,
        publisher: GrpcRemoteWeightUpdater | WeightClient,
        update_weights_interval: int = 1,
        policy_weights_getter: Callable[[], Weights] | None = None,
        weight_update_map: Mapping[str, str] | None = None,
        trainer: Any = None,
        *,
        interval_unit: str = "batches",
    ) -> None:
        if update_weights_interval < 1:
            raise ValueError(f"update_weights_interval must be >= 1, got {update_weights_interval}")
        if interval_unit not in INTERVAL_UNITS:
            raise ValueError(f"interval_unit must be one of {', '.join(INTERVAL_UNITS)}, got {interval_unit!r}")
        self.weight_update_map = dict(weight_update_map or {})
        if isinstance(publisher, WeightClient):
            publisher = GrpcRemoteWeightUpdater(publisher, models=list(self.weight_update_map) or ("policy",))
        if self.weight_update_map:
            published_models = set(publisher.models.values())
            if set(self.weight_update_map) != published_models:
                raise ValueError(
                    f"weight_update_map names the models {sorted(self.weight_update_map)} but the publisher "
                    f"publishes {sorted(published_models)}: pass GrpcRemoteWeightUpdater(..., "
                    f"models={sorted(self.weight_update_map)!r})"
                )
            publisher.policy_weights = self._mapped_weights
        elif policy_weights_getter is not None:
            publisher.policy_weights = policy_weights_getter
        self.publisher = publisher
        self.update_weights_interval = update_weights_interval
        self.policy_weights_getter = policy_weights_getter
        self.trainer = trainer
        self.interval_unit = interval_unit
        self.counter = 0  # calls ("batches")
        self.last_update_count = 0  # optimizer steps at the last publish ("optim_steps")
        self.published: list[int] = []  # versions this hook published

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.interval_unit == "optim_steps":
            count = self._optimizer_step_count()
            if count - self.last_update_count < self.update_weights_interval:
                return
            self.last_update_count = count
        else:
            self.counter += 1
            if self.counter % self.update_weights_interval != 0:
                return
        self.publish()

    def publish(self) -> int | None:
        """Publish now, outside the interval, through the publisher's hooks; returns the new
        version, or None when the publisher's `_skip_update` skipped it."""
        version = self.publisher.update_weights()
        if version is not None:
            self.published.append(version)
        return version

    def _mapped_weights(self) -> dict[str, Any]:
        """{model: the trainer's module at its source path}: the publisher's weight source."""
        if self.trainer is None:
            raise RuntimeError("weight_update_map needs the trainer: pass trainer= or call register(trainer)")
        return {dest: resolve_path(self.trainer, src) for dest, src in self.weight_update_map.items()}

    def _optimizer_step_count(self) -> int:
        if self.trainer is None:
            raise RuntimeError('interval_unit="optim_steps" needs the trainer: pass trainer= or call register(trainer)')
        # As torchrl's UpdateWeights: the stepper's count of optimizer steps (it discounts
        # gradient-accumulation micro-steps and skipped steps), else the trainer's loop counter.
        count = getattr(getattr(self.trainer, "optimization_stepper", None), "optimizer_step_count", None)
        return int(count if count is not None else self.trainer._optim_count)

    def register(self, trainer: Any, name: str = "update_weights") -> None:
        """Register with a torchrl Trainer (kept for weight_update_map and optimizer steps): at
        "post_steps", or at "post_optim" with interval_unit="optim_steps"."""
        self.trainer = trainer
        trainer.register_module(name, self)
        trainer.register_op("post_optim" if self.interval_unit == "optim_steps" else "post_steps", self)

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter, "last_update_count": self.last_update_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counter = int(state.get("counter", 0))
        self.last_update_count = int(state.get("last_update_count", 0))
