"""The TorchRL updater design over the weight server.

`GrpcLocalWeightUpdater` (collector side) pulls and applies versions; `GrpcRemoteWeightUpdater`
(trainer side) publishes them. Both need torch and tensordict, never torchrl.
"""

from __future__ import annotations

import logging
import random
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
from weightclient.core.service_client import FetchedBytes, FetchStats
from weightclient.core.version_follower import VersionFollower
from weightclient.torchrl.key_mapping import IDENTITY, KeyMap, check_weights, map_keys
from weightclient.torchrl.updaters import LocalWeightUpdaterBase, RemoteWeightUpdaterBase, WorkerId
from weightserver.protocol.errors import (
    CursorOutOfRange,
    DeadlineExceeded,
    ModelNotFound,
    ServerUnavailable,
    WeightServerError,
)
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.version_info import VersionInfo

log = logging.getLogger(__name__)

Weights = torch.nn.Module | TensorDictBase | Mapping[str, torch.Tensor]
UNAVAILABLE_MAX_BACKOFF = 5.0  # seconds between fetch attempts while the server is down
# The deadline of each call an update makes: 5-10x a 256 MiB fetch over loopback (0.1-0.3 s
# by shared memory, 0.5-1 s by the stream), short enough for a collector to wait out.
DEFAULT_UPDATE_TIMEOUT = 5.0
# An attempt that waited t seconds for a stalled server is not repeated for STALL_BACKOFF * t:
# a collector spends at most a fifth of its time waiting for a server that does not answer.
STALL_BACKOFF = 4.0


class _LazyClient:
    """Holds a WeightClient, or the address to make one from on first use. The channel is
    dropped when pickled (it cannot cross processes) and made again where it is needed."""

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

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["_client"] = None
        return state


def weights_of(source: Weights) -> TensorDictBase:
    """Parameters and buffers of a module (as the live tensors), or the given weights."""
    if isinstance(source, torch.nn.Module):
        return TensorDict.from_module(source)
    if isinstance(source, TensorDictBase):
        return source
    return TensorDict(dict(source), batch_size=[])


@dataclass(frozen=True)
class Update:
    """A version pulled from the server and not yet applied (see `GrpcLocalWeightUpdater.pull`).

    Attributes:
        info: the version's description (number, tensors, digests, metadata).
        weights: its tensors as the server names them (flat keys), before any key map.
        partial: a delta: `weights` holds only the tensors changed since the applied version.
        stats: how the fetch went (transport, bytes on the wire, seconds).
        buffer: the updater's receive buffer, lent to this update (`weights` may view it);
            `apply` hands it back, so apply an update once, before pulling the next.
    """

    info: VersionInfo
    weights: TensorDictBase = field(repr=False)
    partial: bool = False
    stats: FetchStats | None = None
    buffer: memoryview | None = field(default=None, repr=False, compare=False)

    @property
    def version(self) -> int:
        return self.info.version


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
        watch: follow the model's Watch stream and ask the server only once it announced a
            newer version (and every `watch_confirm_seconds` regardless), not every update.
        cut_through: with watch=True, receive each version while the trainer is still
            publishing it (its bytes as they reach the server, over bulk TCP or the stream),
            so that it is ready about when it commits; it is applied only once its commit is
            announced and the bytes match the committed version. Off with `dtype` or
            transport="shm" (a same-host publish over shared memory is announced only at its
            commit anyway). A whole version travels even where a delta would be smaller.
        update_timeout: the deadline, in seconds, of every call the updater makes (each call
            of a fetch, `latest` for `lag`): a server that does not answer in time is treated
            as one that is down. Raise it for a fetch that takes longer (a large model, a
            slow link).

    `update_weights()` (or calling the updater) runs two public steps: `pull()` fetches the
    next version, if any, into a reused staging buffer as an `Update`, changing nothing;
    `apply(update)` runs the design's hooks on it, on every transport alike. What
    `_maybe_map_weights` returns (keyed like the policy, flat or nested; with ``delta=True``
    only the changed tensors' keys) is what lands, or nothing at all. The client is made
    lazily and dropped when pickled, so an updater can be sent to a worker process.

    >>> updater = GrpcLocalWeightUpdater("localhost:50051", policy=policy)   # doctest: +SKIP
    >>> update = updater.pull()        # updater() does both steps  # doctest: +SKIP
    >>> if update is not None: updater.apply(update)                # doctest: +SKIP
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
        self._applied: VersionInfo | None = None  # the description of the applied version (delta base)
        self._staging: memoryview | None = None  # receive buffer, lent to a pulled Update until applied
        self._follower: VersionFollower | None = None
        self._last_asked = 0.0  # monotonic time the server last answered a fetch
        self._waiting_logged = False
        self._unavailable_since: float | None = None  # monotonic time the server went away
        self._stalled = False  # the last failed call ran out of time (rather than finding no server)
        self._failures = 0
        self._next_attempt = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_staging"] = None
        state["_follower"] = None  # a thread: the copy follows again where it is used
        return state

    def __del__(self) -> None:
        follower = getattr(self, "_follower", None)
        if follower is not None:
            follower.stop()

    @property
    def lag(self) -> int | None:
        """Server's latest version minus the applied one; None before any is applied and while
        the server is unavailable. With watch=True the latest announced version stands in for
        the server's while the server answered within `watch_confirm_seconds`."""
        if self.version is None or self._backing_off():
            return None
        newest = self._follower.newest() if self._follower is not None else None
        if newest is not None and not self._confirm_due():
            return max(0, newest - self.version)
        began = time.monotonic()
        try:
            # A collector reads this between batches: one try, within update_timeout.
            latest = self.client.latest(self.model, retry=False, timeout=self.update_timeout)
        except (ServerUnavailable, DeadlineExceeded) as exc:
            self._server_unavailable(exc, began)
            return None
        self._server_available()
        return max(0, latest.version - self.version)  # a server behind the policy (see pull) is 0 behind

    @property
    def following(self) -> bool:
        """With watch=True: whether the Watch stream is open, so that updates skip the server."""
        return self._follower is not None and self._follower.newest() is not None

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

    # ------------------------------------------------------------------ the two public steps
    def pull(self) -> Update | None:
        """Fetch the version this updater should apply next, without applying it.

        None when there is nothing to apply: nothing newer (or announced, with watch=True), no
        version yet, or the server unavailable or not answering within `update_timeout`
        (logged once per outage, asked again with backoff). Other errors (integrity, a pinned
        version gone) raise; the policy is untouched.
        """
        if self._backing_off():
            return None  # the server is down: keep the current weights, try again later
        if self.pinned_version is not None and self.version == self.pinned_version:
            return None
        if self._nothing_announced():
            return None
        early = self._follower.take_ready(self.version or 0, self.update_timeout) if self._follower else None
        if early is not None:
            return self._early_update(early)
        options = {
            "base": self._applied if self.delta and self.version is not None else None,
            "dtype": self.dtype,
            "transport": self.transport,
            "into": self._staging,
            "retry": False,
            "timeout": self.update_timeout,
        }
        began = time.monotonic()
        try:
            if self.pinned_version is not None:
                result = self.client.fetch(self.model, version=self.pinned_version, **options)
            else:
                result = self.client.fetch(self.model, newer_than=self.version or 0, **options)
        except CursorOutOfRange:
            # This server (a relay, or the next address after a failover) is behind the version
            # the policy holds: nothing newer here, and never an older version.
            self._server_available()
            self._last_asked = time.monotonic()
            return None
        except ModelNotFound:
            if not self._waiting_logged:
                log.info(
                    "no version of model %r on %s yet; keeping the current weights", self.model, self.client.address
                )
                self._waiting_logged = True
            return None
        except (ServerUnavailable, DeadlineExceeded) as exc:
            self._server_unavailable(exc, began)
            return None
        self._server_available()
        self._last_asked = time.monotonic()
        if result is None:
            return None
        self.last_fetch = result.stats
        buffer, self._staging = self._staging, None  # lent to the update until it is applied
        received = result.stats is not None and result.stats.transport != "shm"  # into a buffer of ours
        if received and (buffer is None or result.data.nbytes > buffer.nbytes):
            buffer = result.data
        return Update(result.info, result.weights, partial=result.partial, stats=result.stats, buffer=buffer)

    def apply(self, update: Update) -> None:
        """Write `update` into the policy: `_get_local_weights` -> `_maybe_map_weights` (the key
        map, applied once) -> strict check -> `_update_local_weights`, then set `version`.

        On a mismatch (missing or unexpected keys, shapes, dtypes) the check raises KeyError
        before anything is written. An error while copying (a device failure) leaves no whole
        version: `version` becomes None and the next update fetches the latest whole.
        """
        try:
            local = self._get_local_weights()
            mapped = self._maybe_map_weights(update.weights, local)
            source = f"server weights of {self.model!r} v{update.version}"
            checked = self._checked(mapped, local, source, partial=update.partial, allow_cast=bool(self.dtype))
            self._write(local, checked)
            self.version, self._applied = update.version, update.info
            log.debug("applied %s v%s", self.model, self.version)
        finally:
            if update.stats is not None and update.stats.early and self._follower is not None:
                self._follower.give_back(update.buffer)
            else:
                self._give_back(update.buffer)

    def load(self, weights: Weights) -> None:
        """Copy `weights` keyed like the policy (e.g. another copy of it) into the policy: no
        key map, no `_maybe_map_weights`; checked strictly first, then all of them or none.
        The policy then holds no server version: `version` becomes None and the next update
        fetches the latest version whole."""
        local = self._get_local_weights()
        self._write(local, self._checked(weights_of(weights), local, "weights passed to load", partial=False))
        self.version, self._applied = None, None

    def update_weights(self, weights: Weights | None = None) -> None:
        """`apply(pull())`. Explicit `weights` are taken as server weights (the key map and
        `_maybe_map_weights` apply) covering the whole policy, which then holds no server
        version (`version` becomes None)."""
        if weights is not None:
            local = self._get_local_weights()
            mapped = self._maybe_map_weights(weights_of(weights), local)
            self._write(local, self._checked(mapped, local, "weights passed to update_weights", partial=False))
            self.version, self._applied = None, None
            return
        update = self._get_server_weights()
        if update is not None:
            self.apply(update)

    # ------------------------------------------------------------------ the design's hooks
    def _get_server_weights(self) -> Update | None:  # type: ignore[override]
        return self.pull()

    def _get_local_weights(self) -> TensorDictBase:
        policy = self.policy
        if policy is None:
            collector = self.collector
            policy = getattr(collector, "policy", None) if collector is not None else None
        if policy is None:
            raise RuntimeError("GrpcLocalWeightUpdater has no policy: pass policy= or register a collector")
        return weights_of(policy)

    def _maybe_map_weights(
        self, server_weights: TensorDictBase | None, local_weights: TensorDictBase
    ) -> TensorDictBase | None:
        """The server weights renamed by `key_map` (flat keys); checked afterwards, in `apply`."""
        if server_weights is None:
            return None
        return map_keys(server_weights, self.key_map)

    def _update_local_weights(self, local_weights: TensorDictBase, mapped_weights: TensorDictBase | None) -> None:
        """An in-place copy, so that shared-memory and CUDA parameters stay valid (and cast)."""
        if mapped_weights is None:
            return
        with torch.no_grad():
            local_weights.flatten_keys(".").update_(mapped_weights)

    # ------------------------------------------------------------------ internals
    def _checked(
        self, mapped: Any, local: TensorDictBase, source: str, *, partial: bool, allow_cast: bool = False
    ) -> TensorDictBase:
        if not isinstance(mapped, (TensorDictBase, Mapping)):
            raise TypeError(
                f"{type(self).__name__}._maybe_map_weights returned {type(mapped).__name__} for the {source}; "
                "it must return the weights keyed like the local policy (a TensorDict or a mapping)"
            )
        return check_weights(mapped, local, source=source, partial=partial, allow_cast=allow_cast)

    def _write(self, local: TensorDictBase, checked: TensorDictBase) -> None:
        try:
            self._update_local_weights(local, checked)
        except BaseException:
            # Some tensors may hold the new weights and others the old: no version is whole.
            log.error("%s: writing weights into the policy failed; it holds no verified version now", self.model)
            self.version, self._applied = None, None
            raise

    def _early_update(self, early: FetchedBytes) -> Update:
        """An Update of a version the follower received while it was published (cut-through)."""
        self._server_available()
        self._last_asked = time.monotonic()  # its commit was just announced
        self.last_fetch = early.stats
        tensors = tensor_codec.decode(parse_header(early.data), early.data)
        weights = TensorDict(tensors, batch_size=[])
        return Update(early.info, weights, partial=False, stats=early.stats, buffer=early.data)

    def _give_back(self, buffer: memoryview | None) -> None:
        if buffer is not None and (self._staging is None or buffer.nbytes > self._staging.nbytes):
            self._staging = buffer

    def _nothing_announced(self) -> bool:
        """With watch=True: nothing newer was announced and the server was asked recently."""
        if not self.watch or self.pinned_version is not None or self.version is None:
            return False
        if self._follower is None or not self._follower.running():  # first time, or a forked child
            early = None
            if self.cut_through and not self.dtype and self.transport != "shm":
                early = CutThrough(self.client, transport=self.transport, timeout=self.update_timeout)
            self._follower = VersionFollower(self.client, self.model, since=self.version, cut_through=early)
        newest = self._follower.newest()
        if newest is None or newest > self.version:
            return False
        return not self._confirm_due()

    def _confirm_due(self) -> bool:
        """The server last answered a fetch, and the Watch stream last showed life (an event, or
        bytes it announced still arriving), `watch_confirm_seconds` ago or more: what the stream
        announced may be stale (a stream can stall without an error)."""
        heard = self._follower.heard() if self._follower is not None else 0.0
        return time.monotonic() - max(self._last_asked, heard) >= self.watch_confirm_seconds

    def _backing_off(self) -> bool:
        return self._unavailable_since is not None and time.monotonic() < self._next_attempt

    def _server_unavailable(self, error: WeightServerError, began: float) -> None:
        """A call begun at `began` found no server or ran out of time: keep the current
        weights, warn once per outage, back off (longer after a call that waited)."""
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
        backoff = min(UNAVAILABLE_MAX_BACKOFF, 0.1 * 2**self._failures)
        self._next_attempt = now + max(backoff, STALL_BACKOFF * (now - began))
        self._failures += 1

    def _server_available(self) -> None:
        if self._unavailable_since is not None:
            log.warning(
                "weight server %s is back after %.1fs", self.client.address, time.monotonic() - self._unavailable_since
            )
            self._unavailable_since, self._stalled = None, False


class GrpcRemoteWeightUpdater(_LazyClient, RemoteWeightUpdaterBase):
    """Trainer-side updater: publishes the trainer's weights as a new version.

    Args:
        client: a WeightClient, or the server address.
        policy_weights: the trainer's module / TensorDict, or a callable returning the weights
            (or a ``{model: weights}`` mapping to publish several models as one version).
        models: worker id -> model name; a sequence of names means each name is its own worker
            id. Default: one worker, ``"policy"``.
        max_interval: as in TorchRL's Ray updater: a worker is updated at most every
            ``max_interval + 1`` calls (0: every call).
        retries, backoff: a publish that finds the server unavailable (or whose deadline
            passed) is retried this many times with exponential backoff and jitter, then raises.
            Every attempt carries the same publish id, so a retry after a lost reply yields the
            version already committed, never a second one. Updates are never dropped silently.
        transport: how the weights travel (`WeightClient.publish`): "auto" (shared memory on
            the server's host, else bulk TCP, else the stream), "shm", "bulk" or "stream".

    One `update_weights()` publishes every selected model in ONE stream under one version,
    through the design's hooks (`_get_server_weights` -> `_maybe_map_weights` -> per worker
    `_skip_update`, `_sync_weights_with_worker`); a subclass may override any of them.
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
        self.backoff = backoff
        self.metadata = metadata
        self._calls_since_update = dict.fromkeys(self.models, 0)
        self._group: dict[str, Weights] | None = None  # the version `update_weights` is building
        self.version: int | None = None  # last version published

    def all_worker_ids(self) -> list[WorkerId]:
        return list(self.models)

    def _get_server_weights(self) -> Any:
        source = self.policy_weights
        if source is None:
            raise RuntimeError("GrpcRemoteWeightUpdater has no weights: pass policy_weights= or update_weights(w)")
        if callable(source) and not isinstance(source, torch.nn.Module):
            source = source()
        return source

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        return server_weights

    def _skip_update(self, worker_id: WorkerId) -> bool:
        self._calls_since_update[worker_id] = self._calls_since_update.get(worker_id, 0) + 1
        return self._calls_since_update[worker_id] <= self.max_interval

    def _sync_weights_with_worker(self, worker_id: WorkerId, server_weights: Any) -> None:
        """Deliver `worker_id`'s model: inside `update_weights` it joins the version being
        built (committed once every due worker is in); called on its own, it is published
        as a version of its own."""
        model = self.models[worker_id]
        weights = self._weights_for(model, server_weights)
        if self._group is not None:
            self._group[model] = weights
            return
        self.publish({model: weights})
        self._calls_since_update[worker_id] = 0

    def update_weights(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> int | None:
        """Publish the models of the selected workers (default: all) as ONE new version.

        The design's order: `_get_server_weights()` (or `weights`) -> `_maybe_map_weights` ->
        for each worker, `_skip_update` and `_sync_weights_with_worker`. Returns the version
        published, or None when `_skip_update` skipped every worker (nothing published).
        Workers that share a model publish it once; different models land under one version.
        """
        server_weights = self._get_server_weights() if weights is None else weights
        mapped = self._maybe_map_weights(server_weights)
        group: dict[str, Weights] = {}
        due: list[WorkerId] = []
        self._group = group
        try:
            for worker in self._resolve_workers(worker_ids):
                if self._skip_update(worker):
                    continue
                self._sync_weights_with_worker(worker, mapped)
                due.append(worker)
        finally:
            self._group = None
        if not due:
            return None
        version = self.publish(group)
        for worker in due:
            self._calls_since_update[worker] = 0
        return version

    @staticmethod
    def _weights_for(model: str, server_weights: Any) -> Weights:
        if isinstance(server_weights, Mapping) and model in server_weights:
            return server_weights[model]
        return server_weights

    def publish(self, weights_by_model: Mapping[str, Weights], metadata: Mapping[str, str] | None = None) -> int:
        """Publish ``{model: weights}`` as one version, retrying while the server is unavailable
        (exactly once: every attempt sends the same publish id)."""
        meta = dict(self.metadata() if self.metadata else {})
        meta.update(metadata or {})
        publish_id = uuid.uuid4().hex
        for attempt in range(self.retries + 1):
            try:
                self.version = self.client.publish_group(
                    dict(weights_by_model), metadata=meta, publish_id=publish_id, transport=self.transport
                )
                return self.version
            except (ServerUnavailable, DeadlineExceeded) as exc:
                if attempt == self.retries:
                    raise
                delay = self.backoff * 2**attempt * (0.5 + random.random())
                log.warning(
                    "publish of %s failed (%s); retry %d/%d in %.2fs",
                    ", ".join(weights_by_model),
                    exc,
                    attempt + 1,
                    self.retries,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")
