"""Released torchrl (0.14.x): `GrpcWeightSyncScheme` for any collector, `ServerPolicyVersion` to stamp
batches with the server version. A trainer needs only ``UpdateWeights(sender=GrpcRemoteWeightUpdater())``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torchrl.envs.llm.transforms.policy_version import PolicyVersion
from torchrl.weight_update import SharedMemWeightSyncScheme

from weightclient.client import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater, Update

with warnings.catch_warnings():
    # torchrl.collectors defines WeightUpdaterBase subclasses, which warn.
    warnings.filterwarnings(
        "ignore", message=r"Creating \w+ which inherits from WeightUpdaterBase", category=DeprecationWarning
    )
    from torchrl.collectors import Collector

__all__ = ["Collector", "GrpcWeightSyncScheme", "ServerPolicyVersion"]


class ServerPolicyVersion(PolicyVersion):
    """A PolicyVersion that, after each weight update, adopts the server version just applied."""

    def __init__(self) -> None:
        super().__init__(version_type=int)
        self.pending: int | None = None

    def increment_version(self) -> None:
        if self.pending is not None:
            self.version, self.pending = int(self.pending), None


class GrpcWeightSyncScheme(SharedMemWeightSyncScheme):
    """``collector.update_policy_weights_()`` applies the server's newer version into a ``Collector``'s
    policy, or into the buffers a multi-process collector's workers share.

    >>> scheme = GrpcWeightSyncScheme("localhost:50051", key_map=KeyMap(add_prefix="module."))   # doctest: +SKIP
    >>> collector = Collector(env, policy, frames_per_batch=64,                                    # doctest: +SKIP
    ...                       weight_sync_schemes={"policy": scheme}, track_policy_version=ServerPolicyVersion())
    `options` go to GrpcLocalWeightUpdater, or ``puller=`` is the whole updater (say, a subclass)."""

    def __init__(
        self,
        client: WeightClient | str | None = None,
        *,
        puller: GrpcLocalWeightUpdater | None = None,
        strategy: str = "tensordict",
        sync: bool = True,
        per_worker_weights: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(strategy=strategy, sync=sync, per_worker_weights=per_worker_weights)
        if puller is None:
            puller = GrpcLocalWeightUpdater(client, **options)
        elif client is not None or options:
            given = ", ".join(["client"] * (client is not None) + list(options))
            raise ValueError(f"puller= is the whole updater: pass {given} to GrpcLocalWeightUpdater (or your subclass)")
        self.puller: GrpcLocalWeightUpdater | None = puller
        self._in_process = False  # a single Collector: no workers, its policy is updated directly
        # The applied server version, shared with the workers.
        self._server_version = torch.full((), -1, dtype=torch.int64).share_memory_()

    @property
    def version(self) -> int | None:
        return self.puller.version if self.puller is not None else None

    @property
    def lag(self) -> int | None:
        return self.puller.lag if self.puller is not None else None

    @property
    def initialized_on_sender(self) -> bool:
        return self._in_process or super().initialized_on_sender

    def init_on_sender(self, *args: Any, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        if not isinstance(context, Collector):
            return super().init_on_sender(*args, model_id=model_id, context=context, **kwargs)
        self._in_process, self.model_id, self.context = True, model_id, context

    def connect(self, **kwargs: Any) -> None:
        if not self._in_process:  # workers to hand the shared buffers to
            return super().connect(**kwargs)
        self.synchronized_on_sender = True

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Apply the server's newer version, or `weights` keyed like the policy."""
        if self.puller is None:
            raise RuntimeError("this GrpcWeightSyncScheme was sent to a worker process; send from the collector")
        update = self.puller.next_update() if weights is None else weights  # (through an overridden hook)
        if update is None and not self._in_process:
            return  # up to date: the workers keep what they have
        self.puller.policy = self.context.policy if self._in_process else self.weights
        if isinstance(update, Update):
            self.puller.apply(update)
        elif update is not None:
            self.puller.load(update)
        version = self.puller.version
        if self._in_process:
            tracker = getattr(self.context, "policy_version_tracker", None)
            if isinstance(tracker, ServerPolicyVersion):
                tracker.pending = version
            elif tracker is not None and version is not None:  # the collector adds one after this
                tracker.version = version - 1
            return
        self._server_version.fill_(-1 if version is None else version)
        super().send(weights=self.weights, worker_ids=worker_ids)

    def _send_ack(self, message: str = "updated") -> None:
        # Private torchrl hook (pinned by a test): runs in a worker right after it applied new
        # weights and bumped its PolicyVersion, where torchrl offers no public hook.
        version = int(self._server_version)
        tracker = getattr(self.context, "policy_version_tracker", None)
        if version >= 0 and tracker is not None:
            tracker.version = version
        super()._send_ack(message)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "puller": None}  # workers never dial the server
