"""UpstreamClient: a relay's calls to the server it follows, each with a deadline.

Built on the generated stubs and Fetch's pre-serialized chunk deserializer (the server never
imports the client package). A failed call raises the domain exception of its status
(weightserver.protocol.errors), as the client package does.

A version is fetched once: as a delta against the version the relay holds when it names one
(`FetchRequest.base_version`), rebuilt whole (`payloads.apply_delta`) and checked against the
upstream's xxh3 of the file; a delta that does not line up is fetched again whole.

How it dials (`UpstreamLink`): plaintext, or TLS (mutual TLS with a client certificate), and a
bearer token sent with every call (ListModels, Watch, Fetch and the receives of bytes still
arriving), as the client package dials (weightserver.protocol.channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import grpc

from weightserver.config import ServerConfig
from weightserver.protocol import framing
from weightserver.protocol.channel import bearer_metadata, channel_credentials
from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.errors import (
    CLIENT_ID_METADATA_KEY,
    ERROR_METADATA_KEY,
    DeadlineExceeded,
    IntegrityError,
    error_from_status,
)
from weightserver.protocol.limits import CHANNEL_OPTIONS, MAX_CHUNK_BYTES
from weightserver.protocol.safetensors_format import TensorEntry
from weightserver.storage.payloads import apply_delta
from weightserver.storage.store import Version
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Deadline of a unary call (ListModels).
CALL_SECONDS = 5.0
# Deadline of a Watch: then it ends and is resubscribed from the newest version held, so even
# an upstream that stopped without closing its connection is asked again this often.
WATCH_SECONDS = 60.0
# Deadline of a Fetch, whatever its size (a 16 GiB model at 10 MiB/s takes 28 minutes) ...
FETCH_SECONDS = 3600.0
# ... and a fetch that receives nothing for this long is dropped (and retried).
FETCH_STALL_SECONDS = 30.0
# Initial metadata of a relay's Watch: the primary it follows, so that a relay of a relay
# names the root of the tree when it refuses a publish.
PRIMARY_METADATA_KEY = "weightserver-primary"


@dataclass(frozen=True)
class UpstreamLink:
    """How a relay dials its upstream: TLS `credentials` (None: plaintext) and the bearer
    `token` its calls carry (None: none). `from_config` reads the PEM files, so a missing or
    wrong one stops the server before it binds its port."""

    credentials: grpc.ChannelCredentials | None = None
    token: str | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: ServerConfig) -> UpstreamLink:
        """The link `config`'s upstream_* settings describe (ValueError naming the option at fault)."""
        credentials = None
        if config.upstream_uses_tls:
            names = ("--upstream-tls-ca", "--upstream-tls-cert", "--upstream-tls-key")
            try:
                credentials = channel_credentials(
                    config.upstream_tls_ca, config.upstream_tls_cert, config.upstream_tls_key, names=names
                )
            except OSError as exc:
                raise ValueError(f"cannot read the upstream's TLS file {exc.filename}: {exc.strerror}") from None
        return cls(credentials, config.upstream_token)

    @property
    def tls(self) -> bool:
        return self.credentials is not None


@dataclass(frozen=True)
class FetchedVersion:
    """A version fetched from the upstream, whole and checked against its xxh3."""

    info: pb.VersionInfo  # the Fetch header: its sha256 is always set
    data: bytes | bytearray = field(repr=False)
    moved: int  # payload bytes received: the delta's, or the whole file's (and a delta's that did not rebuild)
    delta: bool  # rebuilt from a delta against the version the relay held


class UpstreamClient:
    """The calls a relay makes to `address`, dialled as `link` says (default: plaintext, no
    token), on the running event loop.

    `client_id` names the relay in the upstream's logs and per-client metrics. `primary`: the
    address the upstream names as its primary in its Watch's initial metadata (the upstream is
    itself a relay), once a Watch has subscribed; None while it named none.
    """

    def __init__(self, address: str, client_id: str | None = None, link: UpstreamLink | None = None) -> None:
        self.address = address
        self.link = link or UpstreamLink()
        self.primary: str | None = None
        metadata = [bearer_metadata(self.link.token)] if self.link.token else []
        if client_id:
            metadata.append((CLIENT_ID_METADATA_KEY, client_id))
        self._metadata = tuple(metadata) or None  # sent with every call
        if self.link.credentials is not None:
            self._channel = grpc.aio.secure_channel(address, self.link.credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.WeightServiceStub(self._channel)
        service = pb.DESCRIPTOR.services_by_name["WeightService"].full_name
        self._fetch = self._channel.unary_stream(
            f"/{service}/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=framing.deserialize_fetch_response,
        )

    async def close(self) -> None:
        await self._channel.close()

    async def list_models(self) -> list[pb.ModelSummary]:
        with _mapped_errors():
            reply = await self._stub.ListModels(pb.ListModelsRequest(), timeout=CALL_SECONDS, metadata=self._metadata)
        return list(reply.models)

    async def list_versions(self, model: str) -> list[pb.VersionInfo]:
        """The versions of `model` the upstream retains, oldest first (ModelNotFound: none)."""
        with _mapped_errors():
            request = pb.ListVersionsRequest(model=model)
            reply = await self._stub.ListVersions(request, timeout=CALL_SECONDS, metadata=self._metadata)
        return list(reply.versions)

    async def describe(self, model: str, version: int) -> pb.VersionInfo:
        """One version the upstream retains (VersionEvicted, VersionNotFound, ModelNotFound: it does not)."""
        with _mapped_errors():
            request = pb.DescribeRequest(model=model, version=version)
            return await self._stub.Describe(request, timeout=CALL_SECONDS, metadata=self._metadata)

    async def watch(
        self, model: str, since: int, on_subscribed: Callable[[], Awaitable[None]], *, incoming: bool = False
    ) -> AsyncIterator[pb.VersionEvent]:
        """The upstream's events for `model` after `since` (missed retained versions first),
        until WATCH_SECONDS have passed; then it simply ends, to be resubscribed.
        `on_subscribed` is awaited once the upstream has taken the subscription (sent its
        initial metadata, naming its primary if it is a relay). `incoming`: also the
        announcements of publishes whose bytes are arriving (cut-through)."""
        request = pb.WatchRequest(model=model, since=since, incoming=incoming)
        call = self._stub.Watch(request, timeout=WATCH_SECONDS, metadata=self._metadata)
        try:
            with _mapped_errors():
                metadata = dict(await call.initial_metadata() or ())
                if not call.done():  # else refused at once (trailers only): the loop raises its error
                    self.primary = metadata.get(PRIMARY_METADATA_KEY) or None
                    await on_subscribed()
                async for event in call:
                    yield event
        except DeadlineExceeded:
            return
        finally:
            call.cancel()

    async def fetch_version(self, model: str, version: int, base: Version | None) -> FetchedVersion:
        """`version` of `model`, whole: as a delta against `base` (a version this relay holds,
        the same bytes as the upstream's copy) when the upstream sends one that rebuilds to the
        version's xxh3, else the whole file."""
        discarded = 0
        if base is not None:
            info, payload, data = await self._receive(model, version, base.version)
            if payload is None or not payload.base_version:  # the upstream sent the whole file
                return _checked_whole(info, data)
            rebuilt = _rebuilt(base, info, payload, data)
            if rebuilt is not None:
                return FetchedVersion(info, rebuilt, moved=len(data), delta=True)
            log.info(
                "%s v%d: the delta against v%d did not rebuild it; fetching it whole", model, version, base.version
            )
            discarded = len(data)
        info, _, data = await self._receive(model, version, 0)
        return _checked_whole(info, data, discarded)

    async def receive_arriving(
        self, model: str, arriving_id: str, into: memoryview, landed: Callable[[int], None]
    ) -> None:
        """The bytes of a publish still arriving upstream (FetchRequest.incoming), into `into`
        (its declared size) as they come, telling `landed(n)` as the first n are in. Unchecked:
        the caller keeps them only once the upstream's commit names them and they match it.
        PublishAborted when that publish fails; UploadNotFound when it has ended already."""
        request = pb.FetchRequest(model=model, incoming=arriving_id, chunk_size=MAX_CHUNK_BYTES)
        received = 0
        async for message in self._fetched(request, f"{model!r} (a publish's bytes)"):
            if not isinstance(message, memoryview):
                if message.WhichOneof("kind") == "payload" and message.payload.byte_size != into.nbytes:
                    raise IntegrityError(f"{model!r}: the upstream's arriving bytes changed size")
                continue
            end = received + message.nbytes
            if end > into.nbytes:
                raise IntegrityError(f"{model!r}: the upstream sent more arriving bytes than announced")
            into[received:end] = message
            received = end
            landed(received)
        if received != into.nbytes:
            raise IntegrityError(f"{model!r}: {received} of {into.nbytes} arriving bytes came from the upstream")

    async def _fetched(self, request: pb.FetchRequest, what: str) -> AsyncIterator[pb.FetchResponse | memoryview]:
        """A Fetch call's messages (chunks as views), each within FETCH_STALL_SECONDS of the last
        (DeadlineExceeded otherwise); failures as domain exceptions."""
        call = self._fetch(request, timeout=FETCH_SECONDS, metadata=self._metadata)
        messages = aiter(call)
        try:
            with _mapped_errors():
                while True:
                    try:
                        message = await asyncio.wait_for(anext(messages), FETCH_STALL_SECONDS)
                    except StopAsyncIteration:
                        return
                    except asyncio.TimeoutError:  # TimeoutError from 3.11 on
                        raise DeadlineExceeded(
                            f"{what}: the upstream {self.address} sent nothing for {FETCH_STALL_SECONDS:g}s"
                        ) from None
                    yield message
        finally:
            call.cancel()

    async def _receive(
        self, model: str, version: int, base_version: int
    ) -> tuple[pb.VersionInfo, pb.Payload | None, bytearray]:
        """One Fetch: the header, the payload's description (with a base), and its bytes."""
        request = pb.FetchRequest(model=model, version=version, chunk_size=MAX_CHUNK_BYTES, base_version=base_version)
        info: pb.VersionInfo | None = None
        payload: pb.Payload | None = None
        data = bytearray()
        async for message in self._fetched(request, f"{model!r} v{version}"):
            if isinstance(message, memoryview):
                data += message
            elif message.WhichOneof("kind") == "header":
                info = message.header
            elif message.WhichOneof("kind") == "payload":
                payload = message.payload
        if info is None or info.model != model or info.version != version:
            raise IntegrityError(f"{model!r} v{version}: the upstream {self.address} sent another version or none")
        expected = payload.byte_size if payload is not None else info.byte_size
        if len(data) != expected:
            raise IntegrityError(f"{model!r} v{version}: {len(data)} bytes came from the upstream, {expected} expected")
        return info, payload, data


def _checked_whole(info: pb.VersionInfo, data: bytearray, discarded: int = 0) -> FetchedVersion:
    digest = xxh3_hex(data)
    if digest != info.xxh3:
        raise IntegrityError(
            f"{info.model!r} v{info.version}: the bytes fetched have xxh3 {digest}, the upstream's is {info.xxh3}"
        )
    return FetchedVersion(info, data, moved=discarded + len(data), delta=False)


def _rebuilt(base: Version, info: pb.VersionInfo, payload: pb.Payload, delta: bytearray) -> bytearray | None:
    """The version's file from `base` and a delta, if the delta is against the relay's copy
    of `base` and the file it rebuilds has the version's xxh3; else None."""
    if payload.base_version != base.version or payload.base_xxh3 != base.xxh3 or xxh3_hex(delta) != payload.xxh3:
        return None
    layout = [TensorEntry(t.name, t.dtype, tuple(t.shape), t.data_begin, t.data_end) for t in info.tensors]
    rebuilt = apply_delta(base.data, base.header, layout, info.byte_size, delta)
    return rebuilt if rebuilt is not None and xxh3_hex(rebuilt) == info.xxh3 else None


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    """A failed call raises the domain exception of its status and `weightserver-error` name."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        name = dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
        raise error_from_status(exc.code(), exc.details() or "", name) from None
