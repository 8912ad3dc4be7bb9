"""One relay per Ray node: `place_relays(primary)` starts ``weightserver serve --upstream
PRIMARY`` on every node, in an actor pinned to it and named after it (`relay_actor_name`, in
`RELAY_NAMESPACE`); `node_relay_address()` gives a collector its own node's relay, so it fetches
over shared memory. `ray` (the `ray` extra) is imported only when these functions run.

>>> relays = place_relays("10.0.0.5:50051")                       # doctest: +SKIP
>>> node_relay_address()      # inside an actor on a node          # doctest: +SKIP
'127.0.0.1:40321'
>>> relays.stop()                                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from weightserver.process import ServerProcess
from weightserver.protocol.channel import channel_credentials

__all__ = [
    "RELAY_NAMESPACE",
    "RelayPlacement",
    "RelayServer",
    "RelayTLS",
    "node_relay_address",
    "place_relays",
    "relay_actor_name",
]

RELAY_NAMESPACE = "weightserver"


def relay_actor_name(node_id: str) -> str:
    """The name of the relay actor on the Ray node `node_id` (hex)."""
    return f"weightserver-relay-{node_id}"


class RelayServer:
    """A relay actor's body (plain Python): a ``weightserver serve --upstream`` child process,
    serving once the constructor returns, so the actor's methods never see it not up yet."""

    def __init__(
        self, upstream: str, args: Sequence[str] = (), timeout: float = 60.0, tls: RelayTLS | None = None
    ) -> None:
        credentials = None if tls is None else channel_credentials(tls.ca, tls.cert, tls.key)
        self.server = ServerProcess("--upstream", upstream, *args, credentials=credentials).start(timeout)

    def address(self) -> str:
        return self.server.address

    def log(self) -> str:
        return self.server.log()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the relay and wait for it (SIGKILL after `timeout`); return its exit code."""
        try:
            return self.server.stop(timeout)
        except subprocess.TimeoutExpired:  # a relay left behind would hold its port and memory
            self.server.kill()
            raise


@dataclass(frozen=True)
class RelayTLS:
    """PEM files, at the same paths on every node, with which a relay that serves TLS (its
    ``--tls-cert`` among the args) is checked to serve: `ca` signed its certificate; `cert` and
    `key` are a client certificate, for a relay that also has ``--tls-client-ca``."""

    ca: str
    cert: str | None = None
    key: str | None = None


@dataclass
class RelayPlacement:
    """The relays `place_relays` started: `addresses` maps each Ray node id to its relay's
    address (reachable from that node only), `actors` to its actor."""

    upstream: str
    addresses: dict[str, str]
    actors: dict[str, Any] = field(repr=False)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every relay (SIGTERM, then SIGKILL after `timeout`), then end its actor."""
        import ray

        try:
            ray.get([actor.stop.remote(timeout) for actor in self.actors.values()], timeout=timeout + 10)
        finally:
            for actor in self.actors.values():
                ray.kill(actor)
            self.actors = {}

    def __enter__(self) -> RelayPlacement:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def alive_node_ids() -> list[str]:
    """The ids of the Ray cluster's alive nodes."""
    import ray

    return [node["NodeID"] for node in ray.nodes() if node["Alive"]]


def pinned_to(node_id: str) -> Any:
    """A scheduling strategy that keeps an actor on `node_id` (soft=False: never moved)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def place_relays(
    upstream: str,
    *,
    args: Sequence[str] = (),
    node_ids: Sequence[str] | None = None,
    timeout: float = 60.0,
    tls: RelayTLS | None = None,
) -> RelayPlacement:
    """Start one relay of `upstream` on each alive Ray node (or `node_ids`); return once all
    serve. `args`: more ``weightserver serve`` arguments (with ``--tls-cert``, `tls` says how to
    check them). Each actor asks for no CPU and is pinned to its node (soft=False)."""
    import ray

    remote = ray.remote(num_cpus=0)(RelayServer)
    actors = {
        node_id: remote.options(
            name=relay_actor_name(node_id), namespace=RELAY_NAMESPACE, scheduling_strategy=pinned_to(node_id)
        ).remote(upstream, list(args), timeout, tls)
        for node_id in (alive_node_ids() if node_ids is None else node_ids)
    }
    placement = RelayPlacement(upstream, {}, actors)
    try:
        started = ray.get([actor.address.remote() for actor in actors.values()], timeout=timeout + 30)
    except BaseException:
        with contextlib.suppress(Exception):  # the relays that did start; the first error is the one to see
            placement.stop()
        raise
    placement.addresses = dict(zip(actors, started, strict=True))
    return placement


def node_relay_address(timeout: float = 30.0) -> str:
    """The address of this Ray node's relay, waiting up to `timeout` for it (LookupError)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout
    while True:
        try:
            actor = ray.get_actor(relay_actor_name(node_id), namespace=RELAY_NAMESPACE)
            return ray.get(actor.address.remote(), timeout=max(deadline - time.monotonic(), 1.0))
        except ValueError:  # no actor of that name (yet)
            if time.monotonic() > deadline:
                raise LookupError(
                    f"no weightserver relay on Ray node {node_id} after {timeout}s: "
                    "start one per node with weightserver.relay.ray_relays.place_relays(primary)"
                ) from None
            time.sleep(0.2)
