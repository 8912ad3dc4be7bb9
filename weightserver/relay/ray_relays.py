"""One relay per Ray node, in an actor pinned to it, so that collectors fetch over shared memory
from their node's relay (`node_relay_address()`). `ray` is imported only when these run.

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
from typing import Any

from weightserver.process import ServerProcess
from weightserver.protocol.channel import channel_credentials

RELAY_NAMESPACE = "weightserver"
RELAY_ACTOR = "weightserver-relay-{}"  # a node id's relay actor, in RELAY_NAMESPACE


class RelayServer:
    """A relay actor's body: a ``weightserver serve --upstream`` child process, serving once built."""

    def __init__(
        self, upstream: str, args: Sequence[str] = (), timeout: float = 60.0, tls: RelayTLS | None = None
    ) -> None:
        credentials = None if tls is None else channel_credentials(tls.ca, tls.cert, tls.key)
        self.server = ServerProcess("--upstream", upstream, *args, credentials=credentials).start(timeout)

    def address(self) -> str:
        return self.server.address

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the relay and wait for it (SIGKILL after `timeout`); return its exit code."""
        try:
            return self.server.stop(timeout)
        except subprocess.TimeoutExpired:  # a relay left behind would hold its port and memory
            self.server.kill()
            raise


@dataclass(frozen=True)
class RelayTLS:
    """PEM files, the same on every node: `ca` signed the relay's certificate; `cert`, `key`: a client's."""

    ca: str
    cert: str | None = None
    key: str | None = None


@dataclass
class RelayPlacement(contextlib.AbstractContextManager):
    """Each Ray node id's relay address (reachable from that node only) and actor."""

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

    def __exit__(self, *exc: object) -> None:
        self.stop()


def alive_node_ids() -> list[str]:
    import ray

    return [node["NodeID"] for node in ray.nodes() if node["Alive"]]


def pinned_to(node_id: str) -> Any:
    """A scheduling strategy that never moves an actor off `node_id`."""
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
    """Start a relay of `upstream` (more ``serve`` `args`) in a no-CPU actor pinned to each node; wait for all."""
    import ray

    remote = ray.remote(num_cpus=0)(RelayServer)
    actors = {
        node_id: remote.options(
            name=RELAY_ACTOR.format(node_id), namespace=RELAY_NAMESPACE, scheduling_strategy=pinned_to(node_id)
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
            actor = ray.get_actor(RELAY_ACTOR.format(node_id), namespace=RELAY_NAMESPACE)
            return ray.get(actor.address.remote(), timeout=max(deadline - time.monotonic(), 1.0))
        except ValueError:  # no actor of that name (yet)
            if time.monotonic() > deadline:
                raise LookupError(
                    f"no weightserver relay on Ray node {node_id} after {timeout}s: start them with place_relays()"
                ) from None
            time.sleep(0.2)
