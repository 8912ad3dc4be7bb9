"""PublishWeights: torchrl's UpdateWeights hook, publishing through a GrpcRemoteWeightUpdater."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from weightclient.client import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcRemoteWeightUpdater, Weights

INTERVAL_UNITS = ("batches", "optim_steps")
_PATH = re.compile(r"(?:\.?(?:[^.\[\]]+|\[-?\d+\]))+")
_STEP = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")


def resolve_path(root: Any, path: str) -> Any:
    """Follow ``"loss_module.actor_network"`` or ``"replay_buffer.transforms[0]"`` from `root`."""
    if not _PATH.fullmatch(path):
        raise ValueError(f"cannot parse path {path!r}")
    obj = root
    for name, index in _STEP.findall(path):
        try:
            obj = getattr(obj, name) if name else obj[int(index)]
        except (AttributeError, IndexError, KeyError, TypeError) as exc:
            step = name or f"[{index}]"
            raise AttributeError(f"cannot resolve {path!r}: {type(obj).__name__} has no {step!r} ({exc})") from None
    return obj


class PublishWeights:
    """torchrl's ``UpdateWeights`` hook, with no torchrl: publishes every N batches or optimizer steps;
    `weight_update_map`: model -> path on the trainer, all in ONE version (wins over the getter).

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
            if set(self.weight_update_map) != set(publisher.models.values()):
                wanted = sorted(self.weight_update_map)
                raise ValueError(f"weight_update_map's models differ: pass GrpcRemoteWeightUpdater(models={wanted!r})")
            publisher.policy_weights = self._mapped_weights
        elif policy_weights_getter is not None:
            publisher.policy_weights = policy_weights_getter
        self.publisher, self.update_weights_interval = publisher, update_weights_interval
        self.trainer, self.interval_unit = trainer, interval_unit
        self.counter = 0  # calls
        self.last_update_count = 0  # optimizer steps at the last publish
        self.published: list[int] = []

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
        """Publish now: the new version, or None if the publisher skipped it."""
        version = self.publisher.update_weights()
        if version is not None:
            self.published.append(version)
        return version

    def _mapped_weights(self) -> dict[str, Any]:
        if self.trainer is None:
            raise RuntimeError("weight_update_map needs the trainer: pass trainer= or call register(trainer)")
        return {dest: resolve_path(self.trainer, src) for dest, src in self.weight_update_map.items()}

    def _optimizer_step_count(self) -> int:
        if self.trainer is None:
            raise RuntimeError('interval_unit="optim_steps" needs the trainer: pass trainer= or call register(trainer)')
        # As torchrl's UpdateWeights: the stepper's count, else the private Trainer._optim_count (pinned).
        count = getattr(getattr(self.trainer, "optimization_stepper", None), "optimizer_step_count", None)
        return int(count if count is not None else self.trainer._optim_count)

    def register(self, trainer: Any, name: str = "update_weights") -> None:
        self.trainer = trainer
        trainer.register_module(name, self)
        trainer.register_op("post_optim" if self.interval_unit == "optim_steps" else "post_steps", self)

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter, "last_update_count": self.last_update_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counter = int(state.get("counter", 0))
        self.last_update_count = int(state.get("last_update_count", 0))
