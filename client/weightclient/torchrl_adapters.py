"""Adapters that plug the weight server into released torchrl (0.14.x; extra `torchrl`).

* `GrpcCollectorWeightUpdater`: a ``torchrl.collectors.weight_update.WeightUpdaterBase`` for a
  single ``Collector(weight_updater=...)``: ``collector.update_policy_weights_()`` with no
  weights pulls the server's newer version (nothing moves when up to date), maps keys, checks
  them strictly and copies in place. It also works when torchrl's own
  ``UpdateWeights(collector, N)`` hook triggers the update.
* `GrpcWeightSyncScheme`: a ``SharedMemWeightSyncScheme`` for ``MultiSyncCollector`` /
  ``MultiAsyncCollector``: the parent pulls from the server and hands the weights to
  torchrl's shared-memory transport. It pickles without its channel; workers never dial.
* `ServerPolicyVersion`: with ``Collector(track_policy_version=ServerPolicyVersion())`` every
  batch's ``("next", "policy_version")`` is the server version whose weights produced it
  (`GrpcWeightSyncScheme` writes the same entry in multi-process workers).
* Trainer side needs no adapter: ``torchrl.trainers.UpdateWeights(sender=GrpcRemoteWeightUpdater(...),
  update_weights_interval=N)`` calls its ``update_weights()``.

torchrl deprecates ``WeightUpdaterBase`` in favour of weight-sync schemes; both paths are
offered because both are what torchrl 0.14 collectors accept.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs.llm.transforms.policy_version import PolicyVersion
from torchrl.weight_update import SharedMemWeightSyncScheme

from weightclient.client import WeightClient
from weightclient.grpc_updaters import GrpcLocalWeightUpdater
from weightclient.key_mapping import IDENTITY, KeyMap, apply_strict

with warnings.catch_warnings():
    # Importing torchrl.collectors defines its own WeightUpdaterBase subclasses, which warn.
    warnings.filterwarnings(
        "ignore", message=r"Creating \w+ which inherits from WeightUpdaterBase", category=DeprecationWarning
    )
    from torchrl.collectors.weight_update import WeightUpdaterBase

__all__ = ["GrpcCollectorWeightUpdater", "GrpcWeightSyncScheme", "ServerPolicyVersion"]


class ServerPolicyVersion(PolicyVersion):
    """A PolicyVersion transform that records the server version of the weights in use.

    The collector calls `increment_version` after each weight update; this adopts the version
    the updater just applied, and stays put when the server had nothing newer.
    """

    def __init__(self) -> None:
        super().__init__(version_type=int)
        self.pending: int | None = None

    def increment_version(self) -> None:
        if self.pending is not None:
            self.version, self.pending = int(self.pending), None


def _set_pending_version(collector: Any, version: int | None) -> None:
    tracker = getattr(collector, "policy_version_tracker", None)
    if version is None or tracker is None:
        return
    if isinstance(tracker, ServerPolicyVersion):
        tracker.pending = version
    else:  # a plain PolicyVersion: the collector adds one after the update
        tracker.version = version - 1


with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", message=r"Creating \w+ which inherits from WeightUpdaterBase", category=DeprecationWarning
    )

    class GrpcCollectorWeightUpdater(WeightUpdaterBase):
        """Pull a single torchrl Collector's policy weights from the weight server.

        >>> updater = GrpcCollectorWeightUpdater("localhost:50051")                                    # doctest: +SKIP
        >>> collector = Collector(env, policy, frames_per_batch=64, weight_updater=updater,             # doctest: +SKIP
        ...                       track_policy_version=ServerPolicyVersion())
        >>> collector.update_policy_weights_()   # applies the server's newer version, if any          # doctest: +SKIP

        The arguments are GrpcLocalWeightUpdater's; ``watch=True`` asks the server only after
        its Watch stream announced a newer version, not before every batch.
        """

        def __init__(
            self,
            client: WeightClient | str | None = None,
            *,
            model: str = "policy",
            key_map: KeyMap | Any = IDENTITY,
            version: int | None = None,
            delta: bool = True,
            dtype: str | None = None,
            transport: str = "auto",
            watch: bool = False,
        ) -> None:
            options = {"version": version, "delta": delta, "dtype": dtype, "transport": transport, "watch": watch}
            self.puller = GrpcLocalWeightUpdater(client, model=model, key_map=key_map, **options)

        @property
        def version(self) -> int | None:
            """The server version applied to the collector's policy."""
            return self.puller.version

        @property
        def lag(self) -> int | None:
            return self.puller.lag

        def _get_server_weights(self) -> TensorDictBase | None:
            # The live policy, so that a whole version can be received straight into it.
            self.puller.policy = getattr(self.collector, "policy", None)
            return self.puller._get_server_weights()

        def _maybe_map_weights(self, server_weights: Any) -> Any:
            return server_weights  # mapped against the live policy in _sync_weights_with_worker

        def all_worker_ids(self) -> None:
            return None

        def _sync_weights_with_worker(self, *, worker_id: Any = None, server_weights: Any) -> None:
            if server_weights is None:  # up to date; the collector still counts an update
                _set_pending_version(self.collector, self.puller.version)
                return
            local = TensorDict.from_module(self.collector.policy)
            if isinstance(server_weights, torch.nn.Module):
                server_weights = TensorDict.from_module(server_weights)
            from_server = server_weights is not None and self.puller._incoming_version is not None
            mapped = (
                self.puller._maybe_map_weights(server_weights, local)
                if from_server
                else apply_strict(server_weights, local, source="weights passed to update_policy_weights_")
            )
            self.puller._update_local_weights(local, mapped)
            if from_server:
                _set_pending_version(self.collector, self.puller.version)
                self.puller._incoming_version = None

        def __getstate__(self) -> dict[str, Any]:
            state = self.__dict__.copy()
            state["_collector_wrs"] = None
            return state


class GrpcWeightSyncScheme(SharedMemWeightSyncScheme):
    """Weight sync for MultiSyncCollector / MultiAsyncCollector that pulls from the server.

    In the parent, ``collector.update_policy_weights_()`` (or ``update_at_each_batch=True``)
    asks the server for a version newer than the one applied; when there is none nothing is
    sent to the workers. A new version is mapped onto the policy's keys, checked strictly and
    written into torchrl's shared-memory buffers, which the workers apply. With
    ``track_policy_version=True`` the workers stamp each batch with the server version.

    >>> scheme = GrpcWeightSyncScheme("localhost:50051", key_map=KeyMap(add_prefix="module."))   # doctest: +SKIP
    >>> collector = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=64,               # doctest: +SKIP
    ...                                weight_sync_schemes={"policy": scheme}, track_policy_version=True)

    The server arguments are GrpcLocalWeightUpdater's (``watch=True``: the parent asks the
    server only after its Watch stream announced a newer version); the rest go to torchrl's
    SharedMemWeightSyncScheme.
    """

    def __init__(
        self,
        client: WeightClient | str | None = None,
        *,
        model: str = "policy",
        key_map: KeyMap | Any = IDENTITY,
        version: int | None = None,
        delta: bool = True,
        dtype: str | None = None,
        transport: str = "auto",
        watch: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        options = {"version": version, "delta": delta, "dtype": dtype, "transport": transport, "watch": watch}
        self.puller = GrpcLocalWeightUpdater(client, model=model, key_map=key_map, **options)
        # The applied server version, shared with the workers (it travels in the pickle).
        self._server_version = torch.full((), -1, dtype=torch.int64).share_memory_()

    @property
    def version(self) -> int | None:
        return self.puller.version

    @property
    def lag(self) -> int | None:
        return self.puller.lag

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        if weights is None:
            server_weights = self.puller._get_server_weights()
            if server_weights is None:
                return  # up to date: the workers keep what they have
            local = TensorDict.from_module(self.model)
            mapped = self.puller._maybe_map_weights(server_weights, local)
            weights = mapped.unflatten_keys(".")
            self.puller.version, self.puller._incoming_version = self.puller._incoming_version, None
            self.puller._applied = self.puller._incoming_info
            self._server_version.fill_(self.puller.version)
        super().send(weights=weights, worker_ids=worker_ids)

    def _send_ack(self, message: str = "updated") -> None:
        # Runs in a worker right after it applied new weights and bumped its PolicyVersion:
        # stamp the server version instead (torchrl has no public hook for this moment).
        version = int(self._server_version)
        tracker = getattr(self.context, "policy_version_tracker", None)
        if version >= 0 and tracker is not None:
            tracker.version = version
        super()._send_ack(message)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # Workers never dial the server: no channel, no key map (it may be a lambda).
        state["puller"] = GrpcLocalWeightUpdater(self.puller._address, model=self.puller.model)
        return state
