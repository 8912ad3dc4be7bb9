"""The seed's updaters over the weight server: `GrpcLocalWeightUpdater` (collector side) pulls
and applies versions, `GrpcRemoteWeightUpdater` (trainer side) publishes them. Both need torch
and tensordict, never torchrl."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from weightclient import tensors as tensor_codec
from weightclient.client import WeightClient
from weightclient.core.cut_through import CutThrough
from weightclient.core.retry import Deadline, RetryPolicy
from weightclient.core.service_client import FetchedBytes, FetchStats
from weightclient.core.version_follower import VersionFollower
from weightclient.torchrl.key_mapping import IDENTITY, KeyMap, check_weights, map_keys
from weightclient.torchrl.updaters import LocalWeightUpdaterBase, RemoteWeightUpdaterBase, WorkerId
from weightserver.protocol.errors import CursorOutOfRange, DeadlineExceeded, ModelNotFound, ServerUnavailable
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.version_info import VersionInfo

log = logging.getLogger(__name__)

Weights = torch.nn.Module | TensorDictBase | Mapping[str, torch.Tensor]
UNREACHABLE = (ServerUnavailable, DeadlineExceeded)
# The deadline of each call an update makes: 5-10x a 256 MiB fetch over loopback.
DEFAULT_UPDATE_TIMEOUT = 5.0
# How soon a collector asks a server that was down again: 0.1 s doubling to 5 s.
UNAVAILABLE_RETRY = RetryPolicy(first=0.1, longest=5.0, jitter=0.0, retry_on=UNREACHABLE)
# ... and at least 4x as long as its last call waited: a collector spends at most a fifth of its
# time waiting for a server that does not answer.
STALL_BACKOFF = 4.0


class _LazyClient:
    """A WeightClient, or the address to make one from on first use; dropped when pickled
    (a channel cannot cross processes) and made again where it is needed."""

    _address: str | None = None
    _client: WeightClient | None = None

    def _set_client(self, client: WeightClient | str | None) -> None:
        self._address = ",".join(client.addresses) if isinstance(client, WeightClient) else client
        self._client = client if isinstance(client, WeightClient) else None

    @property
    def client(self) -> WeightClient:
        if self._client is None:
            self._client = WeightClient(self._address)
        return self._client

    @property
    def connected(self) -> bool:
        """Whether this process holds a client (a pickled copy holds none until its first call)."""
        return self._client is not None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["_client"] = None
        return state


def weights_of(source: Weights) -> TensorDictBase:
    """A module's parameters and buffers (the live tensors), or the given weights."""
    if isinstance(source, torch.nn.Module):
        return TensorDict.from_module(source)
    if isinstance(source, TensorDictBase):
        return source
    return TensorDict(dict(source), batch_size=[])


@dataclass(frozen=True)
class Update:
    """Weights to apply with `GrpcLocalWeightUpdater.apply`: a version pulled (`info`), or
    weights given by the caller (no `info`; `keyed_like_policy`: no key map, no hooks).
    `weights`: flat keys; `partial`: a delta (only the tensors changed since the applied
    version); `buffer`: the receive buffer `weights` may view, lent until `apply` hands it back
    (apply a pulled update once, before pulling the next)."""

    info: VersionInfo | None
    weights: TensorDictBase = field(repr=False)
    partial: bool = False
    stats: FetchStats | None = None
    buffer: memoryview | None = field(default=None, repr=False, compare=False)
    keyed_like_policy: bool = False

    @property
    def version(self) -> int | None:
        return self.info.version if self.info is not None else None


class GrpcLocalWeightUpdater(_LazyClient, LocalWeightUpdaterBase):
    """Collector-side updater: applies the server's newest version of `model` to a policy.

    Args:
        client: a WeightClient, or the server address (default `$WEIGHTSERVER_ADDRESS`).
        model: model name on the server.
        policy: the module (or TensorDict) to update; default: the registered collector's.
        key_map: how server keys become policy keys (a KeyMap or a function of the key).
        version: pin to this exact version instead of following the latest.
        delta: once a version is applied, ask only for the tensors that changed since.
        dtype: "BF16"/"F16": float32 tensors travel cast, cast back by the in-place copy.
        transport: "auto", "shm", "bulk" or "stream" (see WeightClient.fetch).
        watch: follow the model's Watch stream; ask the server only once it announced a newer
            version (and every `watch_confirm_seconds` regardless: a stream can stall silently).
        cut_through: with watch=True, receive each incoming version while the trainer still
            publishes it; it is applied only once its commit is announced and the bytes match.
            Off with `dtype` or transport="shm" (a same-host publish is announced at its commit).
        update_timeout: the deadline of every call an update (or `lag`) makes; a server that
            does not answer in time is treated as down. Raise it for large models, slow links.

    `update_weights()` is `apply(pull())`: `pull` fetches the next version, if any, into a reused
    buffer and changes nothing; `apply` runs the design's hooks on it, on every transport alike.
    What `_maybe_map_weights` returns lands whole, or nothing does.

    >>> updater = GrpcLocalWeightUpdater("localhost:50051", policy=policy)   # doctest: +SKIP
    >>> update = updater.pull()                                             # doctest: +SKIP
    >>> if update is not None: updater.apply(update)                        # doctest: +SKIP
    """

    def __init__(
        self,
        client: WeightClient | str | None = None,
        *,
        model: str = "policy",
        policy: torch.nn.Module | TensorDictBase | None = None,
        key_map: KeyMap | Callable[[str], str | None] = IDENTITY,
        version: int | None = None,
        delta: bool = True,
        dtype: str | None = None,
        transport: str = "auto",
        watch: bool = False,
        watch_confirm_seconds: float = 1.0,
        update_timeout: float = DEFAULT_UPDATE_TIMEOUT,
        cut_through: bool = True,
    ) -> None:
        if not (isinstance(update_timeout, (int, float)) and update_timeout > 0):
            raise ValueError(
                f"update_timeout must be a number of seconds > 0 (the deadline of each call an update makes), "
                f"got {update_timeout!r}"
            )
        self._set_client(client)
        self.model = model
        self.policy = policy
        self.key_map = key_map
        self.pinned_version = version
        self.delta = delta
        self.dtype = dtype
        self.transport = transport
        self.watch = watch
        self.cut_through = cut_through
        self.watch_confirm_seconds = watch_confirm_seconds
        self.update_timeout = float(update_timeout)
        self.version: int | None = None  # the version applied to the policy
        self.last_fetch: FetchStats | None = None
        self._applied: VersionInfo | None = None  # the applied version's description (delta base)
        self._staging: memoryview | None = None  # receive buffer, lent to a pulled Update
        self._follower: VersionFollower | None = None
        self._incoming: CutThrough | None = None  # the follower's receiver of incoming versions
        self._last_asked = 0.0  # monotonic time the server last answered a fetch
        self._waiting_logged = False
        self._unavailable_since: float | None = None
        self._stalled = False  # the last failed call ran out of time (rather than finding no server)
        self._failures = 0
        self._next_attempt = Deadline()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_staging=None, _follower=None, _incoming=None)  # the copy follows where it is used
        return state

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop following the Watch stream (the next update with watch=True follows again)."""
        follower, self._follower, self._incoming = getattr(self, "_follower", None), None, None
        if follower is not None:
            follower.stop()

    @property
    def applied(self) -> VersionInfo | None:
        """The description of the version the policy holds (None: none, or weights not pulled)."""
        return self._applied

    @property
    def announced(self) -> int | None:
        """With watch=True: the newest version the Watch stream announced; None while no stream is open."""
        return self._follower.newest() if self._follower is not None else None

    @property
    def following(self) -> bool:
        """With watch=True: whether the Watch stream is open, so that updates skip the server."""
        return self.announced is not None

    @property
    def receiving(self) -> bool:
        """Whether an incoming version (one still being published) is being received now."""
        return self._incoming is not None and self._incoming.busy()

    @property
    def lag(self) -> int | None:
        """Server's latest version minus the applied one; None before any is applied and while
        the server is unavailable. With watch=True the announced version stands in for it while
        the server answered within `watch_confirm_seconds`."""
        if self.version is None or self._backing_off():
            return None
        if self.announced is not None and not self._confirm_due():
            return max(0, self.announced - self.version)
        began = time.monotonic()
        try:  # read between batches: one try, within update_timeout
            latest = self.client.latest(self.model, retry=False, timeout=self.update_timeout)
        except UNREACHABLE as exc:
            self._server_unavailable(exc, began)
            return None
        self._server_available()
        return max(0, latest.version - self.version)  # a server behind the policy (see pull) is 0 behind

    @property
    def server_available(self) -> bool:
        """False from a failed fetch until one succeeds again (the policy keeps its weights)."""
        return self._unavailable_since is None

    @property
    def status(self) -> str:
        """One line for progress displays: the applied version, or why there is none."""
        applied = f"v{self.version}" if self.version is not None else "no version applied"
        if self._unavailable_since is not None:
            down = time.monotonic() - self._unavailable_since
            why = f" (no answer within update_timeout={self.update_timeout:g}s)" if self._stalled else ""
            return f"{applied}; server {self.client.address} unavailable for {down:.0f}s{why}"
        return applied

    def pull(self) -> Update | None:
        """The version to apply next, fetched and not applied; None when there is none: nothing
        newer (or announced), or the server unavailable or silent for `update_timeout` (logged once
        per outage, asked again with backoff). Other errors (integrity, a pinned version gone) raise."""
        if self._backing_off() or (self.pinned_version is not None and self.version == self.pinned_version):
            return None
        if self._nothing_announced():
            return None
        ready = self._follower.take_ready(self.version or 0, self.update_timeout) if self._follower else None
        if ready is not None:
            return self._incoming_update(ready)
        options = {
            "base": self._applied if self.delta and self.version is not None else None,
            "dtype": self.dtype,
            "transport": self.transport,
            "into": self._staging,
            "retry": False,
            "timeout": self.update_timeout,
        }
        if self.pinned_version is not None:
            options["version"] = self.pinned_version
        else:
            options["newer_than"] = self.version or 0
        began = time.monotonic()
        try:
            result = self.client.fetch(self.model, **options)
        except CursorOutOfRange:
            # This server (a relay, a failover address) is behind the policy: never go back.
            self._server_available(asked=True)
            return None
        except ModelNotFound:
            if not self._waiting_logged:
                log.info(
                    "no version of model %r on %s yet; keeping the current weights", self.model, self.client.address
                )
                self._waiting_logged = True
            return None
        except UNREACHABLE as exc:
            self._server_unavailable(exc, began)
            return None
        self._server_available(asked=True)
        if result is None:
            return None
        self.last_fetch = result.stats
        buffer, self._staging = self._staging, None  # lent to the update until it is applied
        received = result.stats is not None and result.stats.transport != "shm"  # into a buffer of ours
        if received and (buffer is None or result.data.nbytes > buffer.nbytes):
            buffer = result.data
        return Update(result.info, result.weights, partial=result.partial, stats=result.stats, buffer=buffer)

    def apply(self, update: Update) -> None:
        """Write `update` into the policy through the hooks: `_get_local_weights` ->
        `_maybe_map_weights` -> strict check -> `_update_local_weights`; then set `version`
        (None for weights not pulled). A mismatch raises KeyError before anything is written;
        a copy that fails midway leaves no whole version (`version` None)."""
        try:
            local = self._get_local_weights()
            weights = update.weights
            if update.info is not None:
                source = f"server weights of {self.model!r} v{update.version}"
            else:
                source = "weights passed to " + ("load" if update.keyed_like_policy else "update_weights")
            if not update.keyed_like_policy:
                weights = self._maybe_map_weights(weights, local)
                if not isinstance(weights, (TensorDictBase, Mapping)):
                    raise TypeError(
                        f"{type(self).__name__}._maybe_map_weights returned {type(weights).__name__} for the "
                        f"{source}; it must return the weights keyed like the local policy (a TensorDict or a mapping)"
                    )
            cast = bool(self.dtype) and update.info is not None
            checked = check_weights(weights, local, source=source, partial=update.partial, allow_cast=cast)
            try:
                self._update_local_weights(local, checked)
            except BaseException:
                log.error("%s: writing weights into the policy failed; it holds no verified version now", self.model)
                self.version, self._applied = None, None
                raise
            self.version, self._applied = update.version, update.info
        finally:
            if update.stats is not None and update.stats.incoming and self._follower is not None:
                self._follower.give_back(update.buffer)
            elif update.buffer is not None and (self._staging is None or update.buffer.nbytes > self._staging.nbytes):
                self._staging = update.buffer

    def load(self, weights: Weights) -> None:
        """Copy weights keyed like the policy into it (no key map, no `_maybe_map_weights`), all
        or none; the policy then holds no server version and the next update fetches one whole."""
        self.apply(Update(None, weights_of(weights), keyed_like_policy=True))

    def update_weights(self, weights: Weights | None = None) -> None:
        """`apply(pull())`; explicit `weights` are server weights for the whole policy (the hooks
        apply), which then holds no server version."""
        update = self._get_server_weights() if weights is None else Update(None, weights_of(weights))
        if update is not None:
            self.apply(update)

    # ------------------------------------------------------------------ the design's hooks
    def _get_server_weights(self) -> Update | None:  # type: ignore[override]
        return self.pull()

    def _get_local_weights(self) -> TensorDictBase:
        policy = self.policy
        if policy is None and self.collector is not None:
            policy = getattr(self.collector, "policy", None)
        if policy is None:
            raise RuntimeError("GrpcLocalWeightUpdater has no policy: pass policy= or register a collector")
        return weights_of(policy)

    def _maybe_map_weights(
        self, server_weights: TensorDictBase | None, local_weights: TensorDictBase
    ) -> TensorDictBase | None:
        """The server weights renamed by `key_map` (flat keys); `apply` checks them."""
        return None if server_weights is None else map_keys(server_weights, self.key_map)

    def _update_local_weights(self, local_weights: TensorDictBase, mapped_weights: TensorDictBase | None) -> None:
        """An in-place copy, so that shared-memory and CUDA parameters stay valid (and cast)."""
        if mapped_weights is not None:
            with torch.no_grad():
                local_weights.flatten_keys(".").update_(mapped_weights)

    # ------------------------------------------------------------------ internals
    def _incoming_update(self, ready: FetchedBytes) -> Update:
        """An Update of an incoming version the follower received while it was published."""
        self._server_available(asked=True)  # its commit was just announced
        self.last_fetch = ready.stats
        weights = TensorDict(tensor_codec.decode(parse_header(ready.data), ready.data), batch_size=[])
        return Update(ready.info, weights, partial=False, stats=ready.stats, buffer=ready.data)

    def _nothing_announced(self) -> bool:
        """With watch=True: nothing newer was announced and the server was asked recently."""
        if not self.watch or self.pinned_version is not None or self.version is None:
            return False
        if self._follower is None or not self._follower.running():  # first time, or a forked child
            self._incoming = None
            if self.cut_through and not self.dtype and self.transport != "shm":
                self._incoming = CutThrough(self.client, transport=self.transport, timeout=self.update_timeout)
            self._follower = VersionFollower(self.client, self.model, since=self.version, cut_through=self._incoming)
        newest = self._follower.newest()
        return newest is not None and newest <= self.version and not self._confirm_due()

    def _confirm_due(self) -> bool:
        """Neither the server (a fetch) nor the Watch stream (an event, or incoming bytes) showed
        life for `watch_confirm_seconds`: what the stream announced may be stale."""
        heard = self._follower.heard() if self._follower is not None else 0.0
        return time.monotonic() - max(self._last_asked, heard) >= self.watch_confirm_seconds

    def _backing_off(self) -> bool:
        return self._unavailable_since is not None and not self._next_attempt.expired()

    def _server_unavailable(self, error: Exception, began: float) -> None:
        """A call begun at `began` found no server or ran out of time: keep the weights, warn once
        per outage, back off (longer after a call that waited)."""
        now = time.monotonic()
        self._stalled = isinstance(error, DeadlineExceeded)
        if self._unavailable_since is None:
            self._unavailable_since, self._failures = now, 0
            held = f"v{self.version}" if self.version is not None else "its initial weights"
            why = str(error)
            if self._stalled:
                why = (
                    f"weight server at {self.client.address} did not answer within update_timeout="
                    f"{self.update_timeout:g}s (stopped or overloaded, or a fetch that needs longer: raise it)"
                )
            log.warning("%s; the policy keeps %s and catches up when the server is back", why, held)
        wait = max(UNAVAILABLE_RETRY.delay(self._failures), STALL_BACKOFF * (now - began))
        self._next_attempt = Deadline.after(wait)
        self._failures += 1

    def _server_available(self, asked: bool = False) -> None:
        """The server answered; `asked`: a fetch's answer, which confirms what Watch announced."""
        if asked:
            self._last_asked = time.monotonic()
        if self._unavailable_since is not None:
            down = time.monotonic() - self._unavailable_since
            log.warning("weight server %s is back after %.1fs", self.client.address, down)
            self._unavailable_since, self._stalled = None, False


class GrpcRemoteWeightUpdater(_LazyClient, RemoteWeightUpdaterBase):
    """Trainer-side updater: publishes the trainer's weights as a new version.

    Args:
        client: a WeightClient, or the server address.
        policy_weights: the trainer's module / TensorDict, or a callable returning the weights
            (or a ``{model: weights}`` mapping to publish several models as one version).
        models: worker id -> model name; a sequence of names makes each name its own worker id.
        max_interval: as TorchRL's Ray updater: a worker is updated at most every
            ``max_interval + 1`` calls (0: every call).
        retries, backoff: a publish that finds the server unavailable (or out of time) is retried
            this many times, waiting `backoff` seconds doubling, with jitter; then it raises. Every
            attempt carries the same publish id, so a retry after a lost reply cannot commit twice.
        transport: how the weights travel (`WeightClient.publish`): "auto", "shm", "bulk", "stream".

    One `update_weights()` publishes every due worker's model under ONE version, through the
    hooks `_get_server_weights` -> `_maybe_map_weights` -> per worker `_skip_update`,
    `_sync_weights_with_worker`; a subclass may override any of them.
    """

    def __init__(
        self,
        client: WeightClient | str | None = None,
        policy_weights: Weights | Callable[[], Any] | None = None,
        *,
        models: Mapping[WorkerId, str] | Sequence[str] = ("policy",),
        max_interval: int = 0,
        retries: int = 3,
        backoff: float = 0.5,
        metadata: Callable[[], Mapping[str, str]] | None = None,
        transport: str = "auto",
    ) -> None:
        self._set_client(client)
        self.policy_weights = policy_weights
        self.transport = transport
        self.models: dict[WorkerId, str] = dict(models) if isinstance(models, Mapping) else {m: m for m in models}
        if not self.models:
            raise ValueError("models must name at least one model")
        self.max_interval = max(0, max_interval)
        self.retries = retries
        self.retry = RetryPolicy(first=backoff, longest=math.inf, retry_on=UNREACHABLE)
        self.metadata = metadata
        self._calls_since_update = dict.fromkeys(self.models, 0)
        self._building: dict[WorkerId, tuple[str, Weights]] | None = None  # in `update_weights`: due workers
        self.version: int | None = None  # last version published

    def all_worker_ids(self) -> list[WorkerId]:
        return list(self.models)

    def _get_server_weights(self) -> Any:
        source = self.policy_weights
        if source is None:
            raise RuntimeError("GrpcRemoteWeightUpdater has no weights: pass policy_weights= or update_weights(w)")
        return source() if callable(source) and not isinstance(source, torch.nn.Module) else source

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        return server_weights

    def _skip_update(self, worker_id: WorkerId) -> bool:
        self._calls_since_update[worker_id] = self._calls_since_update.get(worker_id, 0) + 1
        return self._calls_since_update[worker_id] <= self.max_interval

    def _sync_weights_with_worker(self, worker_id: WorkerId, server_weights: Any) -> None:
        """Inside `update_weights`, add the worker's model to the version being built; called on
        its own, publish it as a version of its own."""
        model = self.models[worker_id]
        if isinstance(server_weights, Mapping) and model in server_weights:
            server_weights = server_weights[model]
        if self._building is not None:
            self._building[worker_id] = (model, server_weights)
            return
        self.publish({model: server_weights})
        self._calls_since_update[worker_id] = 0

    def update_weights(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> int | None:
        """Publish the selected workers' models (default: all) as ONE version, through the hooks.
        Returns it, or None when `_skip_update` skipped every worker. Workers that share a model
        publish it once."""
        self._building = due = {}
        try:
            super().update_weights(weights, worker_ids)
        finally:
            self._building = None
        if not due:
            return None
        version = self.publish(dict(due.values()))
        for worker in due:
            self._calls_since_update[worker] = 0
        return version

    def publish(self, weights_by_model: Mapping[str, Weights], metadata: Mapping[str, str] | None = None) -> int:
        """Publish ``{model: weights}`` as one version, retried by `self.retry` up to `retries`
        times while the server is unavailable (exactly once: every attempt has one publish id)."""
        meta = {**(self.metadata() if self.metadata else {}), **(metadata or {})}
        publish_id = uuid.uuid4().hex
        attempt = 0
        while True:
            try:
                self.version = self.client.publish_group(
                    dict(weights_by_model), metadata=meta, publish_id=publish_id, transport=self.transport
                )
                return self.version
            except self.retry.retry_on as exc:
                if attempt == self.retries:
                    raise
                log.warning(
                    "publish of %s failed (%s); retry %d/%d",
                    ", ".join(weights_by_model),
                    exc,
                    attempt + 1,
                    self.retries,
                )
                self.retry.wait(attempt)
                attempt += 1
