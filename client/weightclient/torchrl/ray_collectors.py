"""torchrl collectors as Ray actors, each pulling from its own node's relay (over shared memory by
default), so that a version crosses the network once per node; each actor dials its own channel."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from weightclient.client import WeightClient
from weightclient.torchrl.scheme import Collector, GrpcWeightSyncScheme, ServerPolicyVersion
from weightserver.relay.ray_relays import alive_node_ids, node_relay_address, pinned_to

__all__ = ["CollectorStatus", "NodeCollector", "start_node_collectors"]


@dataclass(frozen=True)
class CollectorStatus:
    node_id: str
    relay_address: str
    version: int | None
    transport: str | None


class NodeCollector:
    """A torchrl ``Collector`` in a Ray actor, pulling from its node's relay; kwargs go to ``Collector``."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        make_policy: Callable[[], torch.nn.Module],
        *,
        model: str = "policy",
        transport: str = "shm",
        frames_per_batch: int = 64,
        relay_timeout: float = 30.0,
        **collector_kwargs: Any,
    ) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.relay_address = node_relay_address(relay_timeout)
        self.client = WeightClient(self.relay_address)
        self.scheme = GrpcWeightSyncScheme(self.client, model=model, transport=transport)
        self.policy = make_policy()
        self.collector = Collector(
            make_env(),
            self.policy,
            frames_per_batch=frames_per_batch,
            total_frames=-1,
            weight_sync_schemes={"policy": self.scheme},
            track_policy_version=ServerPolicyVersion(),
            **collector_kwargs,
        )
        self._batches = iter(self.collector)

    def collect(self) -> TensorDictBase:
        self.collector.update_policy_weights_()
        return next(self._batches)

    def status(self) -> CollectorStatus:
        last = self.scheme.puller.last_fetch if self.scheme.puller is not None else None
        return CollectorStatus(self.node_id, self.relay_address, self.scheme.version, last and last.transport)

    def policy_state(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.policy.state_dict().items()}

    def close(self) -> None:
        self.collector.shutdown()
        self.client.close()


def start_node_collectors(
    make_env: Callable[[], Any],
    make_policy: Callable[[], torch.nn.Module],
    *,
    node_ids: Sequence[str] | None = None,
    per_node: int = 1,
    num_cpus: float = 1,
    **kwargs: Any,
) -> list[Any]:
    """`per_node` NodeCollector actors on each alive Ray node (or `node_ids`); start the relays first."""
    import ray

    remote = ray.remote(num_cpus=num_cpus)(NodeCollector)
    return [
        remote.options(scheduling_strategy=pinned_to(node_id)).remote(make_env, make_policy, **kwargs)
        for node_id in (alive_node_ids() if node_ids is None else node_ids)
        for _ in range(per_node)
    ]
