"""The seed's updater contract, with its class names, hooks and call order. Released torchrl never
shipped it (0.8 merged both into a since-deprecated WeightUpdaterBase); needs no torchrl."""

from __future__ import annotations

import abc
import weakref
from typing import Any

import torch
from tensordict import TensorDictBase

WorkerId = int | str | torch.device


class _CollectorRegistration:
    """The collector an updater serves, held weakly (it owns the updater)."""

    _collector_wr: Any = None

    def register_collector(self, collector: Any) -> None:
        if self._collector_wr is not None:
            raise RuntimeError("Cannot register collector twice.")
        self._collector_wr = weakref.ref(collector)

    @property
    def collector(self) -> Any:
        return self._collector_wr() if self._collector_wr is not None else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_collector_wr", None)  # a weakref does not pickle; workers re-register
        return state


class LocalWeightUpdaterBase(_CollectorRegistration, metaclass=abc.ABCMeta):
    """Pulls weights into the local policy: `_get_server_weights` -> `_get_local_weights` ->
    `_maybe_map_weights` -> `_update_local_weights`."""

    @abc.abstractmethod
    def _get_server_weights(self) -> TensorDictBase | None:
        """The weights to apply, or None when the server has nothing new."""

    @abc.abstractmethod
    def _get_local_weights(self) -> TensorDictBase:
        """The tensors the update writes into."""

    @abc.abstractmethod
    def _maybe_map_weights(
        self, server_weights: TensorDictBase | None, local_weights: TensorDictBase
    ) -> TensorDictBase | None:
        """Server weights keyed and shaped like `local_weights` (or None to skip)."""

    def _update_local_weights(self, local_weights: TensorDictBase, mapped_weights: TensorDictBase | None) -> None:
        if local_weights is not None and mapped_weights is not None:
            local_weights.update_(mapped_weights)

    def __call__(self, weights: TensorDictBase | None = None) -> None:
        return self.update_weights(weights=weights)

    def update_weights(self, weights: TensorDictBase | None = None) -> None:
        server_weights = self._get_server_weights() if weights is None else weights
        local_weights = self._get_local_weights()
        self._update_local_weights(local_weights, self._maybe_map_weights(server_weights, local_weights))


class RemoteWeightUpdaterBase(_CollectorRegistration, metaclass=abc.ABCMeta):
    """Pushes the trainer's weights to workers: `_get_server_weights` -> `_maybe_map_weights` ->
    per worker `_skip_update`, `_sync_weights_with_worker` (with the mapped weights)."""

    @abc.abstractmethod
    def _sync_weights_with_worker(self, worker_id: WorkerId, server_weights: Any) -> None: ...

    @abc.abstractmethod
    def _get_server_weights(self) -> Any: ...

    @abc.abstractmethod
    def _maybe_map_weights(self, server_weights: Any) -> Any: ...

    @abc.abstractmethod
    def all_worker_ids(self) -> list[WorkerId]: ...

    def _skip_update(self, worker_id: WorkerId) -> bool:
        return False

    def __call__(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> Any:
        return self.update_weights(weights=weights, worker_ids=worker_ids)

    def update_weights(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> Any:
        mapped_weights = self._maybe_map_weights(self._get_server_weights() if weights is None else weights)
        workers = [worker_ids] if isinstance(worker_ids, (int, str, torch.device)) else worker_ids
        for worker in self.all_worker_ids() if workers is None else workers:
            if not self._skip_update(worker):
                self._sync_weights_with_worker(worker, mapped_weights)
