"""WeightServer: grpc.aio on an event loop in a background thread (start, port, stop, context manager)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import traceback
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from weightserver.config import ServerConfig, url_host
from weightserver.metrics import NoMetrics, ServerMetrics
from weightserver.protocol import framing, page_tables
from weightserver.protocol.limits import MAX_MESSAGE_BYTES
from weightserver.protocol.version_info import description_bytes
from weightserver.service.auth import TokenTable
from weightserver.service.calls import lenient
from weightserver.service.servicer import WeightServicer
from weightserver.storage.store import VersionStore
from weightserver.transports.bulk import BulkEndpoint
from weightserver.transports.shared_memory import SharedMemoryFiles, server_shm_dir
from weightserver.v1 import weights_pb2 as pb

if TYPE_CHECKING:  # the relay is a client of its upstream: imported by relays only
    from weightserver.relay.relay import Relay

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightService"].full_name
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Calls not yet picked up by the loop: gRPC's default (1000) cancels the rest of a burst,
    # e.g. a thousand watchers resubscribing after a restart.
    ("grpc.server.max_pending_requests", 20000),
    ("grpc.server.max_pending_requests_hard_limit", 40000),
]
# gRPC logs a call cancelled before its handler ran (the server stopping as a Watch arrives) as an ERROR: not a fault.
logging.getLogger("grpc._cython.cygrpc").addFilter(
    lambda r: not r.exc_info or r.exc_info[0] is not asyncio.CancelledError
)


def _print_exc(*args: Any, **kwargs: Any) -> None:
    """`traceback.print_exc` for gRPC's Cython module, which (1.85) also prints that cancellation's traceback."""
    if not isinstance(sys.exc_info()[1], asyncio.CancelledError):
        traceback.print_exc(*args, **kwargs)


if getattr(cygrpc, "traceback", None) is traceback:  # a module global, looked up at each call
    cygrpc.traceback = types.SimpleNamespace(**{**vars(traceback), "print_exc": _print_exc})


def add_weight_service(servicer: WeightServicer, server: grpc.aio.Server) -> None:
    """Register WeightService as generated code would, except that Fetch may send pre-serialized chunks
    and a request that does not parse reaches the handler as an `Undecodable` (INVALID_ARGUMENT, not INTERNAL)."""
    service, handlers = pb.DESCRIPTOR.services_by_name["WeightService"], {}
    for method in service.methods:
        streams = ("stream" if method.client_streaming else "unary", "stream" if method.server_streaming else "unary")
        serialize = getattr(pb, method.output_type.name).SerializeToString
        handlers[method.name] = getattr(grpc, "{}_{}_rpc_method_handler".format(*streams))(
            getattr(servicer, method.name),
            request_deserializer=lenient(getattr(pb, method.input_type.name)),
            response_serializer=framing.serialize if method.name == "Fetch" else serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


@contextlib.contextmanager
def _binding(host: str, port: int, option: str) -> Iterator[None]:
    """An OSError binding `option`'s port names it (the socket's own says only "Address already in use")."""
    try:
        yield
    except OSError as exc:
        raise OSError(exc.errno, f"could not bind {url_host(host)}:{port} ({option}): {exc.strerror or exc}") from exc


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS from the config's PEM files; a client CA makes it mutual TLS."""
    assert config.tls_cert is not None and config.tls_key is not None
    client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    pairs = [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]  # (private key, certificate chain)
    return grpc.ssl_server_credentials(pairs, root_certificates=client_ca, require_client_auth=client_ca is not None)


class WeightServer:
    """A running weight server.

    >>> with WeightServer(ServerConfig(host="127.0.0.1", port=0)) as server:
    ...     server.port > 0
    True
    """

    def __init__(self, config: ServerConfig | None = None, store: VersionStore | None = None) -> None:
        self.config = config = config or ServerConfig()
        self._owns_store = store is None
        self.store = store or VersionStore(
            config.data_dir,
            keep=config.keep,
            max_model_bytes=config.max_model_bytes,
            max_header_bytes=config.max_header_bytes,
            max_tensors=config.max_tensors,
            describe=description_bytes,
        )
        # A bad token file or upstream PEM file stops it before it binds.
        self.tokens = TokenTable.load(config.auth_tokens) if config.auth_tokens else None
        if config.upstream is not None:
            from weightserver.relay.relay import check_upstream_tls

            check_upstream_tls(config)
        self.port: int = 0
        self.metrics_port: int | None = None
        self.bulk: BulkEndpoint | None = None
        self.shared_memory: SharedMemoryFiles | None = None
        self.metrics: NoMetrics = NoMetrics()
        self.relay: Relay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready, self._stopped = threading.Event(), threading.Event()
        self._stop_requested: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._grace = config.grace_seconds

    @property
    def address(self) -> str:
        """host:port that clients on this machine can dial."""
        return f"{url_host(self._local_host)}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://{url_host(self._local_host)}:{self.metrics_port}/metrics"

    @property
    def _local_host(self) -> str:
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host

    def start(self) -> WeightServer:
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
        self._grace = self._grace if grace is None else grace
        self._loop.call_soon_threadsafe(self._stop_requested.set)
        self._thread.join()  # (set: start() made it before the loop existed); it sets _stopped

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped; False if `timeout` passed first."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        self._loop = loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            if self._ready.is_set():
                log.exception("server stopped on an error")
            else:
                self._startup_error = exc
        finally:
            # As asyncio.run does: a handler cancelled just before the stop would be destroyed pending.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._ready.set()
            self._stopped.set()
            loop.close()

    async def _serve(self) -> None:
        self._stop_requested, config = asyncio.Event(), self.config
        if config.bulk_port is not None and config.tls:
            log.info("bulk endpoint off: it is plain TCP and the server runs TLS (fetches use the TLS stream)")
        elif config.bulk_port is not None:
            max_connections = config.bulk_max_connections
            with _binding(config.host, config.bulk_port, "--bulk-port"):
                self.bulk = BulkEndpoint(config.host, config.bulk_port, max_connections=max_connections)
            log.info("bulk endpoint on %s:%d (at most %d connections)", config.host, self.bulk.port, max_connections)
        options = [*GRPC_OPTIONS, ("grpc.max_concurrent_streams", config.max_concurrent_streams)]
        server = grpc.aio.server(options=options)
        servicer: WeightServicer | None = None
        try:  # (a start failing from here on closes the bulk endpoint and all it opened, in `finally`)
            shm_dir = server_shm_dir(config.port, config.shm_dir) if config.shm_dir is not None else None
            if shm_dir is not None:  # (None too where the folder does not exist: logged, and shared memory is off)
                self.shared_memory = SharedMemoryFiles(shm_dir)
                log.info("shared-memory payloads in %s", self.shared_memory.directory)
                pages = page_tables.shared_huge_pages()
                if pages is not None and pages not in page_tables.HUGE_SETTINGS:
                    log.info(
                        "shared memory gets 4 KiB pages on this host (%s: %s); as root, `echo advise > %s` "
                        "lets same-host publishes use 2 MiB pages, which are faster to set up and to seal "
                        "(docs/internals/shared-memory.md)",
                        *(page_tables.SHMEM_HUGE_PAGES, pages, page_tables.SHMEM_HUGE_PAGES),
                    )
                if self.tokens is not None:
                    self.shared_memory.directory.chmod(0o700)  # tokens guard calls; permissions guard files
            if config.metrics_port is not None:
                offered = {"bulk": self.bulk, "shm": self.shared_memory}
                transports = ["stream", *(name for name, endpoint in offered.items() if endpoint is not None)]
                self.metrics = ServerMetrics(transports=transports, relay=config.upstream is not None)
                with _binding(config.host, config.metrics_port, "--metrics-port"):
                    self.metrics_port = self.metrics.serve(config.host, config.metrics_port)
                log.info("metrics on http://%s:%d/metrics", url_host(config.host), self.metrics_port)
            self.servicer = servicer = WeightServicer(
                self.store,
                config,
                bulk=self.bulk,
                shared_memory=self.shared_memory,
                tokens=self.tokens,
                metrics=self.metrics,
            )
            add_weight_service(servicer, server)
            health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            if config.upstream is not None:  # before serving: no publish may slip in
                from weightserver.relay.relay import Relay

                self.relay = servicer.relay = Relay(
                    self.store,
                    config,
                    metrics=self.metrics,
                    health=health,
                    incoming=servicer.incoming,
                    on_removed=servicer.forget_removed,
                )
            reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
            with contextlib.suppress(RuntimeError):  # how gRPC says it could not bind (older releases return 0)
                if config.tls:
                    self.port = server.add_secure_port(config.address, server_credentials(config))
                else:
                    self.port = server.add_insecure_port(config.address)
            if self.port == 0:
                # (gRPC says no more; a certificate or key it cannot use fails here too)
                tls = ", or are --tls-cert and --tls-key no PEM certificate chain and its key?" if config.tls else "?"
                raise OSError(f"could not bind {config.address}: is the port in use{tls}")
            await server.start()
            for service in ("", SERVICE_NAME):
                await health.set(service, health_pb2.HealthCheckResponse.SERVING)
            if self.relay is not None:
                await self.relay.start(client_id=f"relay@{socket.gethostname()}:{self.port}")
            security = ("mutual TLS" if config.tls_client_ca else "TLS") if config.tls else "plaintext"
            log.info(
                "serving on %s:%d (%s%s; data dir: %s, keep %d, max model %d bytes)",
                *(config.host, self.port, security, f", {len(self.tokens)} tokens" if self.tokens else ", no auth"),
                *(config.data_dir or "none, versions kept in memory", config.keep, config.max_model_bytes),
            )
            self._ready.set()
            await self._stop_requested.wait()
            log.info("shutting down (grace %.1fs)", self._grace)
            if self.relay is not None:
                await self.relay.stop()
            await health.enter_graceful_shutdown()
            servicer.watches.end_all()
            await server.stop(self._grace)
            log.info("stopped")
        finally:
            if servicer is not None:  # also when the start failed after it was made (a port in use)
                servicer.close()
            if self._owns_store:  # first: a sha256 it finishes may rewrite a shared-memory header
                self.store.close()
            self.metrics.close()
            for endpoint in (self.bulk, self.shared_memory):
                if endpoint is not None:
                    endpoint.close()
