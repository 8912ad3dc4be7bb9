"""The TorchRL weight-updater design (LocalWeightUpdaterBase, RemoteWeightUpdaterBase).

Same class names, method names, call order and semantics as TorchRL's design document for
`torchrl.collectors.weight_update`; released torchrl never shipped these two classes, so they
live here and need only torch and tensordict. `weightclient.torchrl.grpc_updaters` implements them.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any

import torch
from tensordict import TensorDictBase

WorkerId = int | str | torch.device


class _CollectorRegistration:
    """A collector registered once, held by weak reference (the collector owns the updater)."""

    _collector_wr: Any = None

    def register_collector(self, collector: Any) -> None:
        """Register the collector this updater serves. Once registered, no other is accepted."""
        if self._collector_wr is not None:
            raise RuntimeError("Cannot register collector twice.")
        self._collector_wr = weakref.ref(collector)

    @property
    def collector(self) -> Any:
        """The registered collector, or None if none was registered or it was collected."""
        return self._collector_wr() if self._collector_wr is not None else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_collector_wr", None)  # a weakref does not pickle; workers re-register
        return state


class LocalWeightUpdaterBase(_CollectorRegistration, metaclass=abc.ABCMeta):
    """Pulls weights from a server into the local policy: implement the abstract methods;
    `_update_local_weights` copies in place (``local.update_(mapped)``; None: nothing)."""

    @abc.abstractmethod
    def _get_server_weights(self) -> TensorDictBase | None:
        """The weights to apply, or None when the server has nothing new."""

    @abc.abstractmethod
    def _get_local_weights(self) -> TensorDictBase:
        """The local policy's weights, as tensors that the update writes into."""

    @abc.abstractmethod
    def _maybe_map_weights(
        self, server_weights: TensorDictBase | None, local_weights: TensorDictBase
    ) -> TensorDictBase | None:
        """Server weights keyed and shaped like `local_weights` (or None to skip)."""

    def _update_local_weights(self, local_weights: TensorDictBase, mapped_weights: TensorDictBase | None) -> None:
        if local_weights is None or mapped_weights is None:
            return
        local_weights.update_(mapped_weights)

    def __call__(self, weights: TensorDictBase | None = None) -> None:
        return self.update_weights(weights=weights)

    def update_weights(self, weights: TensorDictBase | None = None) -> None:
        """Apply `weights`, or whatever `_get_server_weights` returns, to the local policy."""
        server_weights = self._get_server_weights() if weights is None else weights
        local_weights = self._get_local_weights()
        mapped_weights = self._maybe_map_weights(server_weights, local_weights)
        self._update_local_weights(local_weights, mapped_weights)


class RemoteWeightUpdaterBase(_CollectorRegistration, metaclass=abc.ABCMeta):
    """Pushes weights from the trainer to inference workers: implement the abstract methods;
    override `_skip_update` to throttle some workers."""

    @abc.abstractmethod
    def _sync_weights_with_worker(self, worker_id: WorkerId, server_weights: Any) -> None:
        """Deliver `server_weights` to one worker."""

    @abc.abstractmethod
    def _get_server_weights(self) -> Any:
        """The trainer's current weights."""

    @abc.abstractmethod
    def _maybe_map_weights(self, server_weights: Any) -> Any:
        """The weights as workers expect them."""

    @abc.abstractmethod
    def all_worker_ids(self) -> list[WorkerId]:
        """Every worker this updater serves."""

    def _skip_update(self, worker_id: WorkerId) -> bool:
        return False

    def __call__(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> None:
        return self.update_weights(weights=weights, worker_ids=worker_ids)

    def update_weights(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> None:
        """Send `weights` (default: `_get_server_weights()`) to `worker_ids` (default: all)."""
        server_weights = self._get_server_weights() if weights is None else weights
        # The design document computes the mapping and then sends the unmapped weights; we send
        # what `_maybe_map_weights` returns, which is what the hook is for.
        mapped_weights = self._maybe_map_weights(server_weights)
        for worker in self._resolve_workers(worker_ids):
            if self._skip_update(worker):
                continue
            self._sync_weights_with_worker(worker, mapped_weights)

    def _resolve_workers(self, worker_ids: WorkerId | list[WorkerId] | None) -> list[WorkerId]:
        if isinstance(worker_ids, (int, str, torch.device)):
            return [worker_ids]
        return list(self.all_worker_ids() if worker_ids is None else worker_ids)
