"""WeightServer: the gRPC server's lifecycle (start, port, stop, context manager).

The server runs grpc.aio on an event loop in a background thread, so it can be embedded in a
test or a trainer process as easily as run by `weightserver serve`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from weightserver.config import ServerConfig, url_host
from weightserver.metrics import NoMetrics, ServerMetrics
from weightserver.protocol import framing
from weightserver.protocol.limits import MAX_MESSAGE_BYTES
from weightserver.protocol.version_info import description_bytes
from weightserver.relay.relay import Relay
from weightserver.relay.upstream import UpstreamLink
from weightserver.service import wire
from weightserver.service.auth import TokenTable
from weightserver.service.servicer import WeightServicer
from weightserver.storage.store import VersionStore
from weightserver.transports.bulk import BulkEndpoint
from weightserver.transports.shared_memory import SharedMemoryFiles, server_shm_dir
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightService"].full_name

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Calls that arrived but were not yet picked up by the event loop. gRPC's default (1000)
    # cancels the rest of a burst, e.g. a thousand watchers resubscribing after a restart.
    ("grpc.server.max_pending_requests", 20000),
    ("grpc.server.max_pending_requests_hard_limit", 40000),
]


_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_weight_service(servicer: WeightServicer, server: grpc.aio.Server) -> None:
    """Register WeightService like the generated `add_WeightServiceServicer_to_server`, except
    that Fetch's responses may be pre-serialized chunk messages (see weightserver.protocol.framing), and
    a request that does not parse reaches the handler as a `wire.Undecodable` (INVALID_ARGUMENT
    there, not INTERNAL)."""
    service = pb.DESCRIPTOR.services_by_name["WeightService"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        factory = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=wire.lenient(request_class),
            response_serializer=framing.serialize if method.name == "Fetch" else response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS credentials from the config's PEM files; a client CA makes client certificates
    mandatory (mutual TLS)."""
    assert config.tls_cert is not None and config.tls_key is not None
    client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class WeightServer:
    """A running weight server.

    >>> with WeightServer(ServerConfig(host="127.0.0.1", port=0)) as server:
    ...     server.port > 0
    True
    """

    def __init__(self, config: ServerConfig | None = None, store: VersionStore | None = None) -> None:
        self.config = config or ServerConfig()
        self._owns_store = store is None  # closed with the server (its sha256 worker)
        self.store = store or VersionStore(
            self.config.data_dir,
            keep=self.config.keep,
            max_model_bytes=self.config.max_model_bytes,
            max_header_bytes=self.config.max_header_bytes,
            max_tensors=self.config.max_tensors,
            describe=description_bytes,
        )
        # A bad token file stops the server here, before it binds a port; so does a bad PEM file
        # of the relay's link to its upstream.
        self.tokens = TokenTable.load(self.config.auth_tokens) if self.config.auth_tokens else None
        self.upstream_link = UpstreamLink.from_config(self.config) if self.config.upstream is not None else None
        self.port: int = 0
        # The bound port of /metrics (with config.metrics_port), once started.
        self.metrics_port: int | None = None
        self.bulk: BulkEndpoint | None = None
        self.shared_memory: SharedMemoryFiles | None = None
        self.metrics: NoMetrics = NoMetrics()
        # With config.upstream: what follows the upstream into the store, once started.
        self.relay: Relay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._stop_requested: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._grace = self.config.grace_seconds

    @property
    def address(self) -> str:
        """host:port that clients on this machine can dial."""
        return f"{self._local_host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """http://host:port/metrics when metrics are on and the server has started."""
        return None if self.metrics_port is None else f"http://{url_host(self._local_host)}:{self.metrics_port}/metrics"

    @property
    def _local_host(self) -> str:
        """The bound host, or 127.0.0.1 for a wildcard address (reachable from this machine)."""
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host

    def start(self) -> WeightServer:
        """Bind the port and start serving in a background thread; return self."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(target=self._run, name="weightserver", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let running ones finish for `grace` seconds, then cancel them."""
        if self._loop is None or self._stop_requested is None or self._stopped.is_set():
            return
        if grace is not None:
            self._grace = grace
        self._loop.call_soon_threadsafe(self._stop_requested.set)
        self._stopped.wait()
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped; False if `timeout` passed first."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                log.exception("server stopped on an error")
        finally:
            _cancel_pending(loop)
            self._ready.set()
            self._stopped.set()
            loop.close()

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        config = self.config
        bulk_port = config.bulk_port
        if bulk_port is not None and config.tls:
            log.info("bulk endpoint off: it is plain TCP and the server runs TLS (fetches use the TLS stream)")
            bulk_port = None
        self.bulk = (
            BulkEndpoint(config.host, bulk_port, max_connections=config.bulk_max_connections)
            if bulk_port is not None
            else None
        )
        shm_dir = None
        if config.shm_dir is not None:
            shm_dir = server_shm_dir(config.port, None if config.shm_dir == "auto" else Path(config.shm_dir))
        self.shared_memory = SharedMemoryFiles(shm_dir) if shm_dir is not None else None
        if self.shared_memory is not None and self.tokens is not None:
            # Tokens guard the gRPC calls; payload files are guarded by file permissions:
            # only this user (and root) may read them.
            self.shared_memory.directory.chmod(0o700)
        try:
            if config.metrics_port is not None:
                offered = {"bulk": self.bulk, "shm": self.shared_memory}
                transports = ["stream", *(name for name, endpoint in offered.items() if endpoint is not None)]
                self.metrics = metrics = ServerMetrics(transports=transports, relay=config.upstream is not None)
                self.metrics_port = metrics.serve(config.host, config.metrics_port)
            await self._serve_grpc()
        finally:
            if self._owns_store:  # first: a sha256 it finishes may rewrite a shared-memory header
                self.store.close()
            self.metrics.close()
            if self.bulk is not None:
                self.bulk.close()
            if self.shared_memory is not None:
                self.shared_memory.close()

    async def _serve_grpc(self) -> None:
        options = [*GRPC_OPTIONS, ("grpc.max_concurrent_streams", self.config.max_concurrent_streams)]
        server = grpc.aio.server(options=options)
        servicer = WeightServicer(
            self.store,
            self.config,
            bulk=self.bulk,
            shared_memory=self.shared_memory,
            tokens=self.tokens,
            metrics=self.metrics,
        )
        add_weight_service(servicer, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        if self.config.upstream is not None:  # set before serving: no publish may slip in
            self.relay = servicer.relay = Relay(
                self.store,
                self.config.upstream,
                models=self.config.upstream_models,
                poll_seconds=self.config.upstream_poll_seconds,
                metrics=self.metrics,
                health=health,
                incoming=servicer.incoming,
                link=self.upstream_link,
                on_removed=servicer.forget_removed,
            )
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        if self.config.tls:
            port = server.add_secure_port(self.config.address, server_credentials(self.config))
        else:
            port = server.add_insecure_port(self.config.address)
        if port == 0:
            raise OSError(f"could not bind {self.config.address}: is the port in use?")
        self.port = port
        if self.bulk is not None:
            log.info(
                "bulk endpoint on %s:%d (at most %d connections)",
                self.config.host,
                self.bulk.port,
                self.bulk.max_connections,
            )
        if self.shared_memory is not None:
            log.info("shared-memory payloads in %s", self.shared_memory.directory)
        if self.metrics_port is not None:
            log.info("metrics on http://%s:%d/metrics", url_host(self.config.host), self.metrics_port)
        await server.start()
        for service in ("", SERVICE_NAME):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.relay is not None:  # named in the upstream's logs and per-client lag metrics
            await self.relay.start(client_id=f"relay@{socket.gethostname()}:{port}")
        log.info(
            "serving on %s:%d (%s%s; data dir: %s, keep %d, max model %d bytes)",
            self.config.host,
            port,
            ("mutual TLS" if self.config.tls_client_ca else "TLS") if self.config.tls else "plaintext",
            f", {len(self.tokens)} tokens" if self.tokens is not None else ", no auth",
            self.config.data_dir or "none, versions kept in memory",
            self.config.keep,
            self.config.max_model_bytes,
        )
        self._ready.set()
        await self._stop_requested.wait()
        log.info("shutting down (grace %.1fs)", self._grace)
        if self.relay is not None:
            await self.relay.stop()
        await health.enter_graceful_shutdown()
        servicer.end_watches()
        await server.stop(self._grace)
        servicer.close()
        log.info("stopped")


def _cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and finish the tasks still on the loop, as asyncio.run does: grpc's handler of a
    call cancelled just before the stop (a Watch whose client went away) could otherwise be
    destroyed pending when the loop closes ("Task was destroyed but it is pending!")."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
