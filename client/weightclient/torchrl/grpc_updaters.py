"""The seed's updater contract (its names, hooks and call order; released torchrl never shipped it),
and over the weight server: `GrpcLocalWeightUpdater` pulls versions, `GrpcRemoteWeightUpdater` publishes."""

from __future__ import annotations

import abc
import itertools
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from weightclient.client import FetchResult, WeightClient
from weightclient.core.retry import Deadline, RetryPolicy
from weightclient.core.service_client import FetchStats
from weightclient.core.version_follower import CutThrough, VersionFollower
from weightclient.tensors import Weights, decode
from weightclient.torchrl.key_mapping import IDENTITY, KeyMap, check_weights, map_keys
from weightserver.protocol import errors
from weightserver.protocol.limits import version_number
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.selection import Selection
from weightserver.protocol.version_info import VersionInfo

log = logging.getLogger(__name__)

WorkerId = int | str | torch.device
UNREACHABLE = (errors.ServerUnavailable, errors.DeadlineExceeded)
# The deadline of each call an update makes: 5-10x a 256 MiB fetch over loopback.
DEFAULT_UPDATE_TIMEOUT = 5.0
# A server that was down is asked again after 0.1 s doubling to 5 s, and at least 4x what the failed
# call waited later: a collector spends at most a fifth of its time on a silent server.
UNAVAILABLE_RETRY = RetryPolicy(first=0.1, longest=5.0, jitter=0.0, retry_on=UNREACHABLE)
STALL_BACKOFF = 4.0


class _CollectorRegistration:
    _collector_wr: Any = None  # weak: the collector owns the updater
    _not_pickled: tuple[str, ...] = ("_collector_wr",)  # a weakref does not pickle; workers re-register

    def register_collector(self, collector: Any) -> None:
        if self._collector_wr is not None:
            raise RuntimeError("Cannot register collector twice.")
        self._collector_wr = weakref.ref(collector)

    @property
    def collector(self) -> Any:
        return self._collector_wr() if self._collector_wr is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._not_pickled)}


class LocalWeightUpdaterBase(_CollectorRegistration, metaclass=abc.ABCMeta):
    """Pulls weights into the local policy: `_get_server_weights` (None: nothing new) ->
    `_get_local_weights` -> `_maybe_map_weights` (keyed like the local weights) -> `_update_local_weights`."""

    @abc.abstractmethod
    def _get_server_weights(self) -> TensorDictBase | None: ...

    @abc.abstractmethod
    def _get_local_weights(self) -> TensorDictBase: ...

    @abc.abstractmethod
    def _maybe_map_weights(
        self, server_weights: TensorDictBase | None, local_weights: TensorDictBase
    ) -> TensorDictBase | None: ...

    def _update_local_weights(self, local_weights: TensorDictBase, mapped_weights: TensorDictBase | None) -> None:
        if local_weights is not None and mapped_weights is not None:
            local_weights.update_(mapped_weights)

    def __call__(self, weights: TensorDictBase | None = None) -> None:
        return self.update_weights(weights=weights)

    def update_weights(self, weights: TensorDictBase | None = None) -> None:
        server_weights = self._get_server_weights() if weights is None else weights
        local_weights = self._get_local_weights()
        self._update_local_weights(local_weights, self._maybe_map_weights(server_weights, local_weights))


class RemoteWeightUpdaterBase(_CollectorRegistration, metaclass=abc.ABCMeta):
    """Pushes the trainer's weights to workers: `_get_server_weights` -> `_maybe_map_weights` ->
    per worker `_skip_update`, `_sync_weights_with_worker` (with the mapped weights)."""

    @abc.abstractmethod
    def _sync_weights_with_worker(self, worker_id: WorkerId, server_weights: Any) -> None: ...

    @abc.abstractmethod
    def _get_server_weights(self) -> Any: ...

    @abc.abstractmethod
    def _maybe_map_weights(self, server_weights: Any) -> Any: ...

    @abc.abstractmethod
    def all_worker_ids(self) -> list[WorkerId]: ...

    def _skip_update(self, worker_id: WorkerId) -> bool:
        return False

    def __call__(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> Any:
        return self.update_weights(weights=weights, worker_ids=worker_ids)

    def update_weights(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> Any:
        mapped_weights = self._maybe_map_weights(self._get_server_weights() if weights is None else weights)
        workers = [worker_ids] if isinstance(worker_ids, (int, str, torch.device)) else worker_ids
        for worker in self.all_worker_ids() if workers is None else workers:
            if not self._skip_update(worker):
                self._sync_weights_with_worker(worker, mapped_weights)


class _LazyClient:
    """A WeightClient made on first use (a channel cannot cross processes: a pickle drops it)."""

    _made = False  # `_client` was made here, not passed in: `close` closes it
    _not_pickled = (*_CollectorRegistration._not_pickled, "_client")

    def _set_client(self, client: WeightClient | str | None) -> None:
        given = isinstance(client, WeightClient)
        self._address = ",".join(client.addresses) if given else client
        self._settings = dict(client.settings) if given else {}  # its token and TLS, to dial again after a pickle
        self._client = client if given else None

    @property
    def client(self) -> WeightClient:
        if self._client is None:
            self._client, self._made = WeightClient(self._address, **self._settings), True
        return self._client

    def close(self) -> None:
        """Close the client if made here, from an address (its channel, Watch streams and background publishes,
        flushed first); one passed in is the caller's and stays open. Idempotent; a later call dials again."""
        if self._made and self._client is not None:
            client, self._client, self._made = self._client, None, False
            client.close()

    @property
    def connected(self) -> bool:
        return self._client is not None


def weights_of(source: Weights) -> TensorDictBase:
    """Keyed as its state dict: a module's parameters and persistent buffers, not the buffers it
    makes itself (a rotary embedding's `inv_freq` in a transformers model), which no state dict holds."""
    if isinstance(source, torch.nn.Module):
        weights = TensorDict.from_module(source).flatten_keys(".")
        transient = set(weights.keys()) - set(source.state_dict(keep_vars=True))  # (a TensorDict iterates its batch)
        return weights.exclude(*transient) if transient else weights
    if isinstance(source, TensorDictBase):
        return source
    return TensorDict(dict(source), batch_size=[])


@dataclass(frozen=True)
class Update:
    """Weights to `apply`; `buffer` (which they may view) is lent until applied, before the next pull.
    `mapping`: memory the policy may keep (the version's file mapped copy-on-write, or the buffer a version
    received early lies in); `views`: then a weak reference to the array its tensors hold, dead once none does."""

    info: VersionInfo | None
    weights: TensorDictBase = field(repr=False)
    partial: bool = False
    stats: FetchStats | None = None
    buffer: memoryview | None = field(default=None, repr=False, compare=False)
    keyed_like_policy: bool = False
    mapping: memoryview | None = field(default=None, repr=False, compare=False)
    views: weakref.ref | None = field(default=None, repr=False, compare=False)

    @property
    def version(self) -> int | None:
        return self.info.version if self.info is not None else None


class GrpcLocalWeightUpdater(_LazyClient, LocalWeightUpdaterBase):
    """Collector side: applies the server's newest version of `model` to a policy.

    Args:
        delta: once a version is applied, fetch only the tensors changed since.
        dtype: "BF16"/"F16": float32 tensors travel cast; the in-place copy casts them back.
        watch: fetch once the Watch stream announced a newer version, or every `watch_confirm_seconds`.
        incoming: with watch, receive a version while it is published; applied once its commit is
            announced and the bytes match. Off with `dtype` or `select`, and on the server's host (below).
        select: fetch only these tensors or slices (`weightclient.tensor_parallel(rank, world, plan)`:
            a tensor-parallel rank's shard), for a policy that holds only them; `key_map` applies after.
            Each update holds the whole selection of one version; `version` is that version.
        update_timeout: the deadline of each call, and of each wait for a transfer's bytes (a transfer
            that keeps moving may take longer); past it the server counts as down.
        keep_storage: copy every version into the parameters' own memory, never swap their storage
            (for code that holds views of them: torchrl's Collector keeps `policy_weights`).

    On the server's host (a fetch went over shared memory) and with no `dtype`, each announced version's
    file is read directly (no call, no delta) and applied zero-copy: each parameter that can becomes a
    copy-on-write view of it (`zero_copy`). Elsewhere a version received early (cut-through) is applied
    zero-copy too: parameters view its verified receive buffer; the one they leave receives the next version.
    `updater()` is `apply(pull())`; docs/guides/torchrl.md shows both steps."""

    _not_pickled = (*_LazyClient._not_pickled, "_staging", "_held", "_follower", "_receiver", "_viewed")

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
        incoming: bool = True,
        select: Selection | str | Iterable[str] | None = None,
        keep_storage: bool = False,
    ) -> None:
        if not (isinstance(update_timeout, (int, float)) and update_timeout > 0):
            raise ValueError(f"update_timeout must be a number of seconds > 0, got {update_timeout!r}")
        self._set_client(client)
        self.model, self.policy, self.key_map = model, policy, key_map
        if version is not None:  # refused here, not at the first update in a collector's worker
            version = version_number(version, "version", least=1, meaning="None: follow the newest")
        self.pinned_version, self.delta, self.dtype = version, delta, dtype
        self.transport, self.watch, self.incoming, self.keep_storage = transport, watch, incoming, keep_storage
        self.select = Selection.of(select) if select is not None else None
        self.watch_confirm_seconds, self.update_timeout = watch_confirm_seconds, float(update_timeout)
        self.version: int | None = None  # the version applied to the policy
        self.last_fetch: FetchStats | None = None
        self.zero_copy = False  # the last apply made every parameter a view of the version's file
        self.applied: VersionInfo | None = None  # its description (the delta base); None for weights not pulled
        self._staging: memoryview | None = None  # receive buffer, lent to a pulled Update
        self._held: FetchResult | None = None  # the version whose whole file `_staging` holds
        self._applying: memoryview | None = None  # the mapped file of the update being applied
        self._partial = False  # the update being mapped is a delta (a KeyMap.rename's key may be absent)
        self._swapped = False  # the last apply made parameters views of it
        self._viewed: tuple[memoryview, weakref.ref | None] | None = None  # the received buffer they view, `views`
        self._follower: VersionFollower | None = None
        self._receiver: CutThrough | None = None  # the follower's receiver of incoming versions
        self._last_asked = 0.0  # when a fetch last got an answer (monotonic)
        self._waiting_logged = False
        self._unavailable_since: float | None = None
        self._stalled = False  # the last failed call ran out of time (rather than finding no server)
        self._failures = 0
        self._next_attempt = Deadline()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop following, and close the client if the updater made it (from an address); a later update dials again."""
        follower, self._follower, self._receiver = getattr(self, "_follower", None), None, None
        if follower is not None:
            follower.stop()
        super().close()

    @property
    def announced(self) -> int | None:  # None while no Watch stream is open
        return self._follower.newest() if self._follower is not None else None

    @property
    def following(self) -> bool:
        return self.announced is not None

    @property
    def receiving(self) -> bool:
        return self._receiver is not None and self._receiver.busy()

    @property
    def lag(self) -> int | None:
        """Server's latest version minus the applied one; None before one is applied, or while the server is down."""
        if self.version is None or self._backing_off():
            return None
        if self.announced is not None and not self._confirm_due():
            return max(0, self.announced - self.version)
        began = time.monotonic()
        try:
            latest = self.client.latest(self.model, retry=False, timeout=self.update_timeout)
        except UNREACHABLE as exc:
            self._server_unavailable(exc, began)
            return None
        self._server_available()
        return max(0, latest.version - self.version)  # a server behind the policy (see pull) is 0 behind

    @property
    def server_available(self) -> bool:
        return self._unavailable_since is None

    @property
    def status(self) -> str:
        applied = f"v{self.version}" if self.version is not None else "no version applied"
        if self._unavailable_since is None:
            return applied
        down = time.monotonic() - self._unavailable_since
        why = f" (no answer within update_timeout={self.update_timeout:g}s)" if self._stalled else ""
        return f"{applied}; server {self.client.address} unavailable for {down:.0f}s{why}"

    def pull(self) -> Update | None:
        """The next version, fetched, not applied; None if none, or if the server is down or silent."""
        pinned_held = self.pinned_version is not None and self.version == self.pinned_version
        if pinned_held or self._backing_off() or self._nothing_announced():
            return None
        ready = self._follower.take_ready(self.version or 0, self.update_timeout) if self._follower else None
        if ready is not None:  # an incoming version, received while published; its commit just announced
            self._server_available(asked=True)
            self.last_fetch = ready.stats
            views = np.frombuffer(ready.data, dtype=np.uint8)  # each tensor holds it: gone once none views the buffer
            weights = TensorDict(decode(parse_header(ready.data), views), batch_size=[])
            return Update(
                ready.info, weights, stats=ready.stats, buffer=ready.data, mapping=ready.data, views=weakref.ref(views)
            )
        target = {"newer_than": self.version or 0} if self.pinned_version is None else {"version": self.pinned_version}
        same_host = self.same_host and not self.dtype  # (a cast is copied in: a delta still saves)
        if same_host and self.pinned_version is None and (self.announced or 0) > (self.version or 0):
            target = {"version": self.announced}  # its header file is read: no call
        options = dict(dtype=self.dtype, transport=self.transport, into=self._staging, retry=False, select=self.select)
        options["stall"] = self.update_timeout  # a transfer whose bytes keep coming may take longer (a large version)
        options["base"] = self.applied if self.delta and not same_host else None
        held, self._held = self._held, None  # the staging buffer is about to be reused
        if options["base"] is not None and not self.dtype:  # element deltas, rebuilt in the buffer on the held
            # version; without one, the whole version, to hold (a partial one would never lead back to deltas)
            keep = held is not None and held.version == self.version
            options["base"], options["consume_base"] = (held, True) if keep else (None, False)
        began = time.monotonic()
        try:
            try:
                result = self.client.fetch(self.model, timeout=self.update_timeout, **options, **target)
            except (errors.VersionNotFound, errors.VersionEvicted):
                if "newer_than" in target or self.pinned_version is not None:
                    raise
                target = {"newer_than": self.version or 0}  # gone already: the newest then
                result = self.client.fetch(self.model, timeout=self.update_timeout, **options, **target)
        except errors.CursorOutOfRange:  # this server (a relay, a failover address) is behind: never go back
            self._server_available(asked=True)
            return None
        except errors.ModelNotFound:
            if not self._waiting_logged:
                log.info("no version of model %r on %s yet", self.model, self.client.address)
                self._waiting_logged = True
            return None
        except UNREACHABLE as exc:
            self._server_unavailable(exc, began)
            return None
        except errors.IntegrityError as exc:
            if not options.get("consume_base"):
                raise
            # Nothing was applied; without the held base the next pull asks for the whole version.
            log.warning("%s: refused a malformed delta on v%s (%s); the policy keeps it", self.model, self.version, exc)
            return None
        self._server_available(asked=True)
        if result is None:
            self._held = held  # up to date: nothing was received
            return None
        self.last_fetch = result.stats
        buffer, self._staging = self._staging, None  # lent to the update until it is applied
        mapped = result.stats is not None and result.stats.transport == "shm"  # else into a buffer of ours
        if not mapped and (buffer is None or result.data.nbytes > buffer.nbytes):
            buffer = result.data
        mapping = result.data if mapped else None
        if not mapped and not result.partial and not result.dtype and _within(result.data, buffer):
            self._held = result  # the staging buffer holds this version's file: the next delta's base
        weights, partial = result.weights, result.partial
        if result.changed is not None and result.base_version == self.version:  # the policy holds the rest
            weights, partial = weights.select(*result.changed), True
        return Update(result.info, weights, partial=partial, stats=result.stats, buffer=buffer, mapping=mapping)

    def apply(self, update: Update) -> None:
        """Write `update` through the hooks, checked first; a copy that fails midway leaves `version` None."""
        try:
            local = self._get_local_weights()
            given = "weights passed to " + ("load" if update.keyed_like_policy else "update_weights")
            source = f"server weights of {self.model!r} v{update.version}" if update.info is not None else given
            self._partial = update.partial
            weights = update.weights if update.keyed_like_policy else self._maybe_map_weights(update.weights, local)
            if not isinstance(weights, (TensorDictBase, Mapping)):
                what = f"{type(self).__name__}._maybe_map_weights returned {type(weights).__name__}"
                raise TypeError(f"{what} for the {source}; it must return the weights keyed like the local policy")
            cast = bool(self.dtype) and update.info is not None
            checked = check_weights(weights, local, source=source, partial=update.partial, allow_cast=cast)
            self._applying = None if self.keep_storage else update.mapping
            self.zero_copy = self._swapped = False
            try:
                self._update_local_weights(local, checked)
            except BaseException:
                log.error("%s: writing weights into the policy failed; it holds no verified version now", self.model)
                self.version, self.applied = None, None
                raise
            self.version, self.applied = update.version, update.info
        finally:
            self._applying, self._partial = None, False
            if update.stats is not None and update.stats.incoming and self._follower is not None:
                if self._swapped:  # the parameters view its buffer: the one they viewed is free once no tensor does
                    freed, self._viewed = self._viewed, (update.buffer, update.views)
                    free = freed is not None and freed[1] is not None and freed[1]() is None
                    self._follower.give_back(freed[0] if free else None)
                else:
                    self._follower.give_back(update.buffer)
            elif update.buffer is not None and (self._staging is None or update.buffer.nbytes > self._staging.nbytes):
                self._staging = update.buffer

    def load(self, weights: Weights) -> None:
        """Copy weights keyed like the policy into it (no key map); it then holds no server version."""
        self.apply(Update(None, weights_of(weights), keyed_like_policy=True))

    def update_weights(self, weights: Weights | None = None) -> None:
        """`apply(pull())`; explicit `weights` are server weights for the whole policy."""
        update = self.next_update() if weights is None else Update(None, weights_of(weights))
        if update is not None:
            self.apply(update)

    def _get_server_weights(self) -> Update | None:  # type: ignore[override]
        return self.pull()

    def next_update(self) -> Update | None:
        """The next update through the `_get_server_weights` hook (`pull()` unless overridden; an override
        may return server weights, as the seed's contract has it); None: nothing new. Schemes call this."""
        got = self._get_server_weights()
        return got if got is None or isinstance(got, Update) else Update(None, weights_of(got))

    def _get_local_weights(self) -> TensorDictBase:
        policy = self.policy if self.policy is not None else getattr(self.collector, "policy", None)
        if policy is None:
            raise RuntimeError("GrpcLocalWeightUpdater has no policy: pass policy= or register a collector")
        return weights_of(policy)

    def _maybe_map_weights(
        self, server_weights: TensorDictBase | None, local_weights: TensorDictBase
    ) -> TensorDictBase | None:
        return None if server_weights is None else map_keys(server_weights, self.key_map, partial=self._partial)

    def _update_local_weights(self, local_weights: TensorDictBase, mapped_weights: TensorDictBase | None) -> None:
        """In place: a copy, so that shared-memory and CUDA parameters stay valid; each parameter that
        can becomes a view of the version's file instead (`_swaps`): all of them, or none on failure."""
        if mapped_weights is None:
            return
        with torch.no_grad():
            local = local_weights.flatten_keys(".")
            swaps = _swaps(local, mapped_weights, self._applying) if self._applying is not None else {}
            copied = mapped_weights.exclude(*swaps) if swaps else mapped_weights
            if not copied.is_empty():
                local.update_(copied)
            held = [(dst, dst.detach()) for dst, _ in swaps.values()]  # the old storage, to put back
            try:
                for dst, src in swaps.values():
                    dst.set_(src)
            except BaseException:
                for dst, old in held:
                    dst.set_(old)
                raise
        self.zero_copy, self._swapped = bool(swaps) and copied.is_empty(), bool(swaps)

    @property
    def same_host(self) -> bool:
        """Whether the last fetch read the server's shared memory (this is the server's host)."""
        return self.last_fetch is not None and self.last_fetch.transport == "shm"

    def _nothing_announced(self) -> bool:
        """While watching: nothing newer was announced and the server was asked recently."""
        if not self.watch or self.pinned_version is not None or self.version is None:
            return False
        if self._follower is None or not self._follower.running():  # first time, or a forked child
            self._receiver = None
            whole = not self.dtype and self.select is None  # (incoming bytes are the whole version's file)
            if self.incoming and whole and self.transport != "shm" and not self.same_host:
                self._receiver = CutThrough(self.client, transport=self.transport, timeout=self.update_timeout)
            self._follower = VersionFollower(self.client, self.model, since=self.version, cut_through=self._receiver)
        newest = self._follower.newest()
        return newest is not None and newest <= self.version and not self._confirm_due()

    def _confirm_due(self) -> bool:
        """Neither a fetch nor the Watch stream showed life for `watch_confirm_seconds`."""
        heard = self._follower.heard() if self._follower is not None else 0.0
        return time.monotonic() - max(self._last_asked, heard) >= self.watch_confirm_seconds

    def _backing_off(self) -> bool:
        return self._unavailable_since is not None and not self._next_attempt.expired()

    def _server_unavailable(self, error: Exception, began: float) -> None:
        """A call begun at `began` failed: keep the weights, warn once per outage, back off."""
        now = time.monotonic()
        self._stalled = isinstance(error, errors.DeadlineExceeded)
        if self._unavailable_since is None:
            self._unavailable_since, self._failures = now, 0
            held = f"v{self.version}" if self.version is not None else "its initial weights"
            stall = f"no answer within update_timeout={self.update_timeout:g}s (stopped, overloaded, or raise it)"
            why = stall if self._stalled else error
            log.warning("weight server %s: %s; the policy keeps %s until it is back", self.client.address, why, held)
        self._next_attempt = Deadline.after(max(UNAVAILABLE_RETRY.delay(self._failures), STALL_BACKOFF * (now - began)))
        self._failures += 1

    def _server_available(self, asked: bool = False) -> None:
        """The server answered; `asked`: a fetch's answer, which confirms what Watch announced."""
        if asked:
            self._last_asked = time.monotonic()
        if self._unavailable_since is not None:
            down = time.monotonic() - self._unavailable_since
            log.warning("weight server %s is back after %.1fs", self.client.address, down)
            self._unavailable_since, self._stalled = None, False


def _within(data: memoryview, buffer: memoryview | None) -> bool:
    """Whether `data` lies in `buffer`'s memory (a fetch received or rebuilt it there)."""
    if buffer is None or not data.nbytes:
        return False
    start, at = (np.frombuffer(view, dtype=np.uint8).ctypes.data for view in (buffer, data))
    return start <= at and at + data.nbytes <= start + buffer.nbytes


def _swaps(
    local: TensorDictBase, mapped: TensorDictBase, mapping: memoryview
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{key: (parameter, tensor)} for each mapped tensor that still views `mapping` (a hook that made
    new tensors gets a copy) and a parameter it can replace whole (the checks below), never one in shared
    memory: torchrl's multi-process collectors keep the workers' parameters there, and one copy."""
    start = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() if mapping.nbytes else 0
    end = start + mapping.nbytes
    swaps = {}
    for key, src in mapped.items():
        dst = local.get(key, None)
        if (
            isinstance(dst, torch.Tensor)
            and start <= src.data_ptr()
            and src.data_ptr() + src.nbytes <= end
            and src.is_contiguous()
            and dst.device == src.device
            and (dst.dtype, dst.shape) == (src.dtype, src.shape)
            and dst.storage_offset() == 0
            and dst.untyped_storage().nbytes() == dst.nbytes
            and not dst.is_shared()
        ):
            swaps[key] = (dst, src)
    return swaps


class GrpcRemoteWeightUpdater(_LazyClient, RemoteWeightUpdaterBase):
    """Trainer side: one `update_weights()` publishes every due worker's model as ONE version.
    `policy_weights`: weights or ``{model: weights}``, or a callable returning them; `models`: worker id
    -> model name; `max_interval`: as torchrl's Ray updater; `retries`: of a publish, `backoff` doubling."""

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
        self.policy_weights, self.transport, self.metadata = policy_weights, transport, metadata
        self.models: dict[WorkerId, str] = dict(models) if isinstance(models, Mapping) else {m: m for m in models}
        if not self.models:
            raise ValueError("models must name at least one model")
        self.max_interval, self.retries = max(0, max_interval), retries
        self.retry = RetryPolicy(first=backoff, longest=math.inf, retry_on=UNREACHABLE)
        self._calls_since_update = dict.fromkeys(self.models, 0)
        self._building: dict[WorkerId, tuple[str, Weights]] = {}  # due workers, in `update_weights`
        self.version: int | None = None  # last version published

    def __enter__(self) -> GrpcRemoteWeightUpdater:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        model = self.models[worker_id]
        if isinstance(server_weights, Mapping) and model in server_weights:
            server_weights = server_weights[model]
        self._building[worker_id] = (model, server_weights)

    def update_weights(self, weights: Any = None, worker_ids: WorkerId | list[WorkerId] | None = None) -> int | None:
        """Publish the due workers' models as ONE version; None when every worker was skipped."""
        self._building = {}
        super().update_weights(weights, worker_ids)
        due, self._building = self._building, {}
        if not due:
            return None
        version = self.publish(dict(due.values()))
        self._calls_since_update.update(dict.fromkeys(due, 0))
        return version

    def publish(self, weights_by_model: Mapping[str, Weights]) -> int:
        """Publish ``{model: weights}`` as one version, retried (with one publish id) while the server is down."""
        meta = self.metadata() if self.metadata else {}
        publish_id = uuid.uuid4().hex
        for attempt in itertools.count():
            try:
                self.version = self.client.publish_group(
                    dict(weights_by_model), metadata=meta, publish_id=publish_id, transport=self.transport
                )
                return self.version
            except self.retry.retry_on as exc:
                if attempt == self.retries:
                    raise
                models = ", ".join(weights_by_model)
                log.warning("publish of %s failed (%s); retry %d/%d", models, exc, attempt + 1, self.retries)
                self.retry.wait(attempt)
