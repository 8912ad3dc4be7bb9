"""Server configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from weightserver.protocol import cpus, limits

# Stream fetches sending at once: a publish's chunks take turns with them on the one event loop (200
# open fetchers starved publishes for seconds); on 2 cores 1-2 was fastest, with no fetch loss vs 4-16.
DEFAULT_MAX_STREAM_FETCHES = max(2, cpus.usable_cpus())


@dataclass(frozen=True)
class ServerConfig:
    """How a weight server runs; every default works on one machine. `serve --help` says what each does."""

    host: str = "0.0.0.0"
    port: int = limits.DEFAULT_PORT
    data_dir: Path | None = None
    keep: int = 3
    max_model_bytes: int = 16 * limits.GiB
    chunk_bytes: int = limits.DEFAULT_CHUNK_BYTES
    max_header_bytes: int = limits.PUBLISH_MAX_HEADER_BYTES  # a published safetensors header's JSON, at most
    max_tensors: int = limits.PUBLISH_MAX_TENSORS  # tensors one published version may list, at most
    grace_seconds: float = 5.0
    bulk_port: int | None = 0  # 0: a free port; None: no bulk transport
    bulk_max_connections: int = 256
    shm_dir: Path | str | None = "auto"  # "auto": /dev/shm if it exists; None: no shared memory
    payload_cache_bytes: int = 1 * limits.GiB
    auth_tokens: Path | None = None  # None: no authorization (see weightserver.service.auth)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS
    max_concurrent_streams: int = 1024
    max_stream_fetches: int = DEFAULT_MAX_STREAM_FETCHES
    publish_timeout: float | None = 600.0  # so that a stalled publish frees its buffer; None: no limit
    metrics_port: int | None = None  # 0: a free port; None: off
    # Relay mode (weightserver.relay): follow the server at this host:port; None: a primary.
    upstream: str | None = None
    upstream_models: tuple[str, ...] | None = None  # None: every model, including later ones
    upstream_poll_seconds: float = 2.0
    upstream_token: str | None = field(default=None, repr=False)  # never shown by repr() or logged
    # TLS to the upstream: on with upstream_tls (the system's roots) or any of the files.
    upstream_tls: bool = False
    upstream_tls_ca: Path | None = None
    upstream_tls_cert: Path | None = None
    upstream_tls_key: Path | None = None

    def __post_init__(self) -> None:
        for name in ("port", "bulk_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0-65535{'' if name == 'port' else ' or None'}, got {value}")
        least = {"keep": 1, "bulk_max_connections": 1, "max_concurrent_streams": 1, "max_stream_fetches": 1}
        for name, low in {**least, "max_model_bytes": 8, "grace_seconds": 0}.items():
            if not getattr(self, name) >= low:  # (so NaN too)
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        low, high = limits.MIN_CHUNK_BYTES, limits.MAX_CHUNK_BYTES
        if not low <= self.chunk_bytes <= high:
            raise ValueError(f"chunk_bytes must be in [{low}, {high}], got {self.chunk_bytes}")
        if self.shm_dir not in (None, "auto"):
            object.__setattr__(self, "shm_dir", Path(self.shm_dir))
        files = ("upstream_tls_ca", "upstream_tls_cert", "upstream_tls_key")
        for name in ("data_dir", "auth_tokens", "tls_cert", "tls_key", "tls_client_ca", *files):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (PEM files) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        if self.publish_timeout is not None and not self.publish_timeout > 0:
            raise ValueError(f"publish_timeout must be > 0 seconds or None, got {self.publish_timeout}")
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
        # How a relay dials its upstream: settings that go together (never quoted: secrets).
        given = [name for name in ("upstream_token", "upstream_tls", *files) if getattr(self, name)]
        if given and self.upstream is None:
            raise ValueError(
                f"{', '.join(given)} are a relay's: give upstream (--upstream ADDRESS) too, or leave them out"
            )
        if (self.upstream_tls_cert is None) != (self.upstream_tls_key is None):
            given, missing = files[1:] if self.upstream_tls_key is None else files[:0:-1]
            raise ValueError(f"{given} without {missing}: a client certificate needs its key; give both or neither")
        if self.upstream_token is not None:
            token = self.upstream_token.strip()
            where = "upstream_token (--upstream-token-file, $WEIGHTSERVER_UPSTREAM_TOKEN)"
            if not token:
                raise ValueError(f"{where} is empty: give the token itself, one line")
            if not all("!" <= c <= "~" for c in token):
                raise ValueError(f"{where}: a token is one word of printable ASCII (no spaces or line breaks)")
            object.__setattr__(self, "upstream_token", token)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def upstream_uses_tls(self) -> bool:
        return self.upstream_tls or any((self.upstream_tls_ca, self.upstream_tls_cert, self.upstream_tls_key))

    @property
    def address(self) -> str:
        return f"{url_host(self.host)}:{self.port}"


def url_host(host: str) -> str:
    """`host` as written in an address or URL: an IPv6 address goes in brackets."""
    return f"[{host}]" if ":" in host else host
