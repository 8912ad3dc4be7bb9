"""Prometheus metrics of one server. Each `ServerMetrics` has its own registry (several servers may
share a process); `NoMetrics` takes the same calls and does nothing, so callers never check."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import platform
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import google.protobuf
import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

import weightserver

if TYPE_CHECKING:
    from weightserver.storage.store import Version

log = logging.getLogger(__name__)

# Seconds, from a small fetch on loopback to a multi-GiB publish over a slow link.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_CLIENT_IDS = 10_000  # client ids with gauges at most: a caller inventing ids cannot grow the server's memory


def build_labels() -> dict[str, str]:
    """The labels of `weightserver_build_info`: the versions this server runs."""
    try:
        version = importlib.metadata.version("weightserver")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        version = weightserver.__version__
    return dict(
        version=version, python=platform.python_version(), grpc=grpc.__version__, protobuf=google.protobuf.__version__
    )


class NoMetrics:
    """Metrics turned off: the calls the servicer and the relay make, each a no-op."""

    def published(self, model: str, nbytes: int, seconds: float) -> None:
        """A version of `model` of `nbytes` was committed; its publish call took `seconds`."""

    def fetched(
        self, model: str, version: int, nbytes: int, seconds: float, *, transport: str, client_id: str | None
    ) -> None:
        """`version` of `model` was served: `nbytes` of payload over `transport`."""

    def watch_started(self, model: str) -> None:
        """A Watch call on `model` subscribed."""

    def watch_ended(self, model: str) -> None:
        """A Watch call on `model` ended (any way)."""

    def retained(self, model: str, versions: Iterable[Version]) -> None:
        """The versions of `model` the store now retains (after a commit, delete or unpin)."""

    def upstream_up(self, up: bool, *, refused: bool = False) -> None:
        """A relay's upstream answers or not; `refused`: it answers, refusing its credentials."""

    def upstream_refusal(self) -> None:
        """A relay's call was refused for its credentials (UNAUTHENTICATED, PERMISSION_DENIED)."""

    def upstream_latest(self, model: str, version: int) -> None:
        """A relay heard that its upstream's newest version of `model` is `version`."""

    def relayed(self, model: str, nbytes: int, *, delta: bool) -> None:
        """A relay fetched a version of `model` from its upstream: `nbytes` of payload, a delta or whole."""

    def close(self) -> None:
        """Stop serving /metrics."""


class ServerMetrics(NoMetrics):
    """One server's `weightserver_*` series; a `relay` also gets `weightserver_relay_*`, and its
    clients' lag counts from its upstream's latest."""

    def __init__(
        self, max_tracked_clients: int = MAX_CLIENT_IDS, transports: Iterable[str] = ("stream",), *, relay: bool = False
    ) -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self._transports = tuple(transports)
        self._http: tuple[WSGIServer, threading.Thread] | None = None
        self._max_clients = max_tracked_clients
        self._lock = threading.Lock()
        self._latest: dict[str, int] = {}
        self._upstream_latest: dict[str, int] = {}  # a relay's: what its clients' lag counts against
        self._client_versions: dict[str, dict[str, int]] = {}
        self._client_ids: set[str] = set()
        self._watchers: dict[str, int] = {}  # Watch calls running, by model
        self._warned_client_cap = False
        common = {"namespace": "weightserver", "registry": self.registry}
        counter, gauge = functools.partial(Counter, **common), functools.partial(Gauge, **common)
        histogram = functools.partial(Histogram, buckets=DURATION_BUCKETS, **common)
        model, by_transport, by_client = ["model"], ["model", "transport"], ["client_id", "model"]
        self.versions_published = counter("versions_published", "Versions committed.", model)
        self.publish_bytes = counter("publish_bytes", "Bytes of committed versions received.", model)
        self.fetch_bytes = counter("fetch_bytes", "Payload bytes served (shm, bulk: handed out).", by_transport)
        self.publish_seconds = histogram("publish_duration_seconds", "Publishes, first message to commit.", model)
        self.fetch_seconds = histogram("fetch_duration_seconds", "Fetches (shm, bulk: until handed out).", by_transport)
        self.active_watchers = gauge("active_watchers", "Watch calls subscribed now.", model)
        self.latest_version = gauge("latest_version", "The newest retained version.", model)
        self.retained_versions = gauge("retained_versions", "Versions the server retains.", model)
        self.retained_bytes = gauge("retained_bytes", "Bytes of the versions retained.", model)
        self.client_version = gauge("client_last_fetched_version", "Each client id's last fetch.", by_client)
        self.client_lag = gauge("client_version_lag", "The latest version minus the client's last.", by_client)
        build = build_labels()
        self.build_info = gauge("build_info", "Always 1; the labels name the versions this server runs.", list(build))
        self.build_info.labels(**build).set(1)
        self.relay = relay
        if relay:
            self.relay_upstream_up = gauge("relay_upstream_up", "1 while the upstream answers, else 0.")
            self.relay_upstream_refused = gauge("relay_upstream_refused", "1 while the upstream refuses this relay.")
            self.relay_upstream_refusals = counter("relay_upstream_refusals", "Calls the upstream refused this relay.")
            latest = "The upstream's newest version, as last heard."
            self.relay_upstream_latest = gauge("relay_upstream_latest_version", latest, model)
            payload = ["model", "payload"]
            self.relay_fetch_bytes = counter("relay_fetch_bytes", "Payload bytes fetched from the upstream.", payload)

    def published(self, model: str, nbytes: int, seconds: float) -> None:
        self.versions_published.labels(model).inc()
        self.publish_bytes.labels(model).inc(nbytes)
        self.publish_seconds.labels(model).observe(seconds)

    def fetched(
        self, model: str, version: int, nbytes: int, seconds: float, *, transport: str, client_id: str | None
    ) -> None:
        self.fetch_bytes.labels(model, transport).inc(nbytes)
        self.fetch_seconds.labels(model, transport).observe(seconds)
        with self._lock:
            if client_id is None:
                return
            if client_id not in self._client_ids and len(self._client_ids) >= self._max_clients:
                if not self._warned_client_cap:
                    log.warning("metrics track %d client ids at most; %r gets none", self._max_clients, client_id)
                    self._warned_client_cap = True
                return
            self._client_ids.add(client_id)
            self._client_versions.setdefault(model, {})[client_id] = version
            latest = max(self._reference(model), version)
            self.client_version.labels(client_id, model).set(version)
            self.client_lag.labels(client_id, model).set(latest - version)

    def watch_started(self, model: str) -> None:
        with self._lock:
            self._watchers[model] = self._watchers.get(model, 0) + 1
            self.active_watchers.labels(model).inc()

    def watch_ended(self, model: str) -> None:
        with self._lock:
            self._watchers[model] -= 1
            if self._watchers[model] or model in self._latest:
                self.active_watchers.labels(model).dec()
                return
            # A model the server never held: a caller may watch any name, so its series goes with its last watcher.
            del self._watchers[model]
            self.active_watchers.remove(model)

    def retained(self, model: str, versions: Iterable[Version]) -> None:
        # Create `model`'s series at zero: a rate needs the zero before the first increment.
        for metric in (self.versions_published, self.publish_bytes, self.publish_seconds):
            metric.labels(model)
        for transport in self._transports:
            self.fetch_bytes.labels(model, transport)
            self.fetch_seconds.labels(model, transport)
        if self.relay:
            for payload in ("delta", "whole"):
                self.relay_fetch_bytes.labels(model, payload)
        versions = list(versions)
        self.retained_versions.labels(model).set(len(versions))
        self.retained_bytes.labels(model).set(sum(v.byte_size for v in versions))
        latest = max((v.version for v in versions), default=0)
        self.latest_version.labels(model).set(latest)
        with self._lock:  # (`watch_ended` removes the watchers' series of a model not in `_latest`)
            self.active_watchers.labels(model)
            self._latest[model] = latest
            self._update_lags(model)

    # The upstream_* and relayed calls come from a relay only: its metrics have relay=True.
    def upstream_latest(self, model: str, version: int) -> None:
        self.relay_upstream_latest.labels(model).set(version)
        with self._lock:
            self._upstream_latest[model] = version
            self._update_lags(model)

    def upstream_up(self, up: bool, *, refused: bool = False) -> None:
        self.relay_upstream_up.set(1 if up else 0)
        self.relay_upstream_refused.set(1 if refused else 0)

    def upstream_refusal(self) -> None:
        self.relay_upstream_refusals.inc()

    def relayed(self, model: str, nbytes: int, *, delta: bool) -> None:
        self.relay_fetch_bytes.labels(model, "delta" if delta else "whole").inc(nbytes)

    def _reference(self, model: str) -> int:
        """What clients' lag counts from: the latest version, or a newer upstream's. Under the lock."""
        return max(self._latest.get(model, 0), self._upstream_latest.get(model, 0))

    def _update_lags(self, model: str) -> None:
        """A new version puts every collector that has not fetched it one further behind. Under the lock."""
        reference = self._reference(model)
        for client_id, version in self._client_versions.get(model, {}).items():
            self.client_lag.labels(client_id, model).set(max(reference - version, 0))

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over plain HTTP on host:port (0: a free port); return the bound port."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        return self._http[0].server_port

    def close(self) -> None:
        if self._http is not None:
            httpd, thread = self._http
            httpd.shutdown()
            httpd.server_close()
            thread.join()
            self._http = None
