"""Server configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from weightserver.protocol.limits import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PORT,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    PUBLISH_MAX_HEADER_BYTES,
    PUBLISH_MAX_TENSORS,
    GiB,
)

# Stream fetches sending chunks at once. One event loop serves every call, so a publish's
# chunks take turns with this many fetches rather than with every open one (200 fetchers
# starved publishes for seconds). One loopback stream already keeps the loop busy: on 2 cores,
# 1-2 turns gave the fastest publishes under load and no less fetch throughput than 4-16.
DEFAULT_MAX_STREAM_FETCHES = max(2, os.cpu_count() or 1)


@dataclass(frozen=True)
class ServerConfig:
    """How a weight server runs. Every field has a default that works on one machine.

    Port 0 picks a free port (read it back from `WeightServer.port`).
    """

    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    data_dir: Path | None = None
    keep: int = 3
    max_model_bytes: int = 16 * GiB
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_header_bytes: int = PUBLISH_MAX_HEADER_BYTES
    max_tensors: int = PUBLISH_MAX_TENSORS
    grace_seconds: float = 5.0
    # Bulk TCP port for large fetches (weightserver.transports.bulk): 0 picks a free one, None turns it off.
    bulk_port: int | None = 0
    # Connections the bulk port keeps open at once; one more is closed at once (it streams).
    bulk_max_connections: int = 256
    # Where to make this server's shared-memory folder: "auto" is /dev/shm if it exists, None: off.
    shm_dir: Path | str | None = "auto"
    # Budget for derived payloads (deltas, casts) kept in memory.
    payload_cache_bytes: int = 1 * GiB
    # Bearer tokens with roles (see weightserver.service.auth); None: no authorization.
    auth_tokens: Path | None = None
    # TLS: certificate chain and private key (PEM); a client CA turns on mutual TLS.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Concurrent calls (HTTP/2 streams) one client connection may have open.
    max_concurrent_streams: int = 1024
    # Stream fetches sending chunks at once; the rest wait their turn (first come, first served).
    max_stream_fetches: int = DEFAULT_MAX_STREAM_FETCHES
    # Seconds a publish stream may take (None: no limit), so a stalled one frees its buffer.
    publish_timeout: float | None = 600.0
    # Prometheus /metrics over plain HTTP (weightserver.metrics): 0 picks a free port, None: off.
    metrics_port: int | None = None
    # Relay mode (weightserver.relay): follow the server at this host:port and refuse publishes.
    # None: this server is a primary.
    upstream: str | None = None
    # The models a relay follows; None: every model the upstream has, including later ones.
    upstream_models: tuple[str, ...] | None = None
    # Seconds between a relay's ListModels calls to its upstream (new models, and whether it is up).
    upstream_poll_seconds: float = 2.0
    # How a relay dials its upstream. The bearer token it sends (an entry of the upstream's
    # --auth-tokens file, role reader); never shown by repr() or logged.
    upstream_token: str | None = field(default=None, repr=False)
    # TLS to the upstream: on with upstream_tls (the system's roots) or any file below; a CA to
    # trust instead of the system's roots; a client certificate and key for mutual TLS.
    upstream_tls: bool = False
    upstream_tls_ca: Path | None = None
    upstream_tls_cert: Path | None = None
    upstream_tls_key: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0-65535, got {self.port}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if self.max_model_bytes < 8:
            raise ValueError(f"max_model_bytes must be >= 8, got {self.max_model_bytes}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port must be in 0-65535 or None, got {self.bulk_port}")
        if self.bulk_max_connections < 1:
            raise ValueError(f"bulk_max_connections must be >= 1, got {self.bulk_max_connections}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0-65535 or None, got {self.metrics_port}")
        if self.shm_dir not in (None, "auto"):
            object.__setattr__(self, "shm_dir", Path(self.shm_dir))
        for name in ("data_dir", "auth_tokens", "tls_cert", "tls_key", "tls_client_ca"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (PEM files) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        if self.publish_timeout is not None and self.publish_timeout <= 0:
            raise ValueError(f"publish_timeout must be > 0 seconds or None, got {self.publish_timeout}")
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}")
        if self.max_stream_fetches < 1:
            raise ValueError(f"max_stream_fetches must be >= 1, got {self.max_stream_fetches}")
        if self.upstream is not None and not self.upstream.strip():
            raise ValueError("upstream must be a host:port, got an empty string")
        if self.upstream_models is not None:
            if self.upstream is None:
                raise ValueError("upstream_models (--models) is what a relay follows: give upstream (--upstream) too")
            if not self.upstream_models:
                raise ValueError("upstream_models must name at least one model, or be None to follow every model")
            object.__setattr__(self, "upstream_models", tuple(self.upstream_models))
        if not self.upstream_poll_seconds > 0:
            raise ValueError(f"upstream_poll_seconds must be > 0, got {self.upstream_poll_seconds}")
        self._check_upstream_link()

    def _check_upstream_link(self) -> None:
        """The settings of a relay's link to its upstream go together (they are checked, never shown)."""
        files = ("upstream_tls_ca", "upstream_tls_cert", "upstream_tls_key")
        for name in files:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        given = [name for name in ("upstream_token", "upstream_tls", *files) if getattr(self, name)]
        if given and self.upstream is None:
            raise ValueError(
                f"{', '.join(given)} say how a relay dials its upstream: give upstream (--upstream ADDRESS) "
                "too, or leave them out on a primary"
            )
        if (self.upstream_tls_cert is None) != (self.upstream_tls_key is None):
            given, missing = (
                ("upstream_tls_cert", "upstream_tls_key")
                if self.upstream_tls_key is None
                else ("upstream_tls_key", "upstream_tls_cert")
            )
            raise ValueError(
                f"{given} without {missing}: the relay's client certificate (mutual TLS to its upstream) "
                "needs its private key; give both --upstream-tls-cert and --upstream-tls-key, or neither"
            )
        if self.upstream_token is not None:
            token = self.upstream_token.strip()
            where = "upstream_token (--upstream-token-file, $WEIGHTSERVER_UPSTREAM_TOKEN)"
            if not token:
                raise ValueError(f"{where} is empty: give the token itself, one line")
            if not all("!" <= c <= "~" for c in token):  # never quoted: it is a secret
                raise ValueError(f"{where}: a token is one word of printable ASCII (no spaces or line breaks)")
            object.__setattr__(self, "upstream_token", token)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def upstream_uses_tls(self) -> bool:
        """A relay dials its upstream over TLS."""
        return self.upstream_tls or any((self.upstream_tls_ca, self.upstream_tls_cert, self.upstream_tls_key))

    @property
    def address(self) -> str:
        return f"{url_host(self.host)}:{self.port}"


def url_host(host: str) -> str:
    """`host` as written in an address or URL: an IPv6 address goes in brackets."""
    return f"[{host}]" if ":" in host else host


def clamp_chunk_bytes(requested: int, default: int = DEFAULT_CHUNK_BYTES) -> int:
    """The chunk size to use for a request asking for `requested` bytes (0 = default)."""
    if requested <= 0:
        return default
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, requested))
