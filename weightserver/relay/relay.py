"""Relay: a server that follows another (`weightserver serve --upstream ADDRESS`) instead of
taking publishes, so that collectors can fetch from a server near them and the primary sends
each version once per relay, not once per collector.

For each model it follows, a relay keeps a Watch open on its upstream, since the newest version
it holds, and fetches each version the Watch announces once: as a delta against the version it
holds when it holds one (weightserver.relay.upstream), rebuilt whole and checked. It commits the
version in its own VersionStore under the upstream's number, metadata and commit time; the
store checks its size, sha256 and xxh3 against the upstream's, so the relay's description and
digests are the upstream's. Its own watchers hear of a version only once the store holds it
whole and verified, and every transport serves it like any version. A relay's upstream may be a
relay: the tree is as deep as you make it.

Missed versions: a version announced but gone upstream before it was fetched (or one the relay
cannot hold) is recorded in the store as missed (`VersionStore.missed`), and so is a jump in
the numbers after the upstream flagged a gap, so that this relay's watchers are told of the gap
as a primary's are.

Deletes: after each poll, the versions held are checked against the upstream's
(`_reconcile`), and those it no longer retains, deleted or evicted there, are dropped: a delete
on the primary leaves a relay within a poll interval, and a relay restarted on its data dir
drops at its first poll what was deleted while it was down. An eviction upstream is treated as
a delete on purpose: after the upstream restarts, an old deleted version looks evicted.

Models: those named (`--models`), else every model the upstream lists, polled every
`poll_seconds` (ListModels), and any model a group publish names. A group publish (several
models under one number) is committed together, as on the primary, once the follower of each of
its models has reached it; a member this relay does not follow is left out of it.

Upstream away: the poll and the Watch calls notice it; the relay keeps serving what it holds,
sets the health service `weightserver.relay` to NOT_SERVING (the server itself stays SERVING)
and `weightserver_relay_upstream_up` to 0, and retries with backoff (woken at once when the
poll reaches the upstream again). Each Watch resubscribes since the newest version held, so the
upstream replays every retained version the relay missed.

Upstream refusing the relay (its token missing, unknown or too small: UNAUTHENTICATED,
PERMISSION_DENIED): reported as "away" is, and besides `weightserver_relay_upstream_refused`
is 1; one error is logged naming the cause and what to set (--upstream-token-file or
$WEIGHTSERVER_UPSTREAM_TOKEN), and the poll backs off as the followers do, so a relay with the
wrong token asks a few times a minute, not continuously. A TLS handshake that fails shows as the
upstream being away (gRPC reports it as UNAVAILABLE); the warning says which TLS options to check.

Changes are refused: Publish, Negotiate to publish, DeleteVersion and PinVersion raise
NotPrimary naming the primary, which is the upstream, or the primary the upstream names in its
Watch's initial metadata when it is a relay itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from weightserver.metrics import NoMetrics
from weightserver.protocol.errors import (
    AuthenticationRequired,
    DeadlineExceeded,
    DescriptionTooLarge,
    IntegrityError,
    InvalidSafetensors,
    ModelNotFound,
    ModelTooLarge,
    NotFoundError,
    NotPrimary,
    PermissionDenied,
    ServerUnavailable,
    VersionConflict,
    VersionEvicted,
    WeightServerError,
)
from weightserver.protocol.names import validate_model_name
from weightserver.publish.incoming import IncomingPublish, IncomingPublishes
from weightserver.relay.upstream import PRIMARY_METADATA_KEY, FetchedVersion, UpstreamClient, UpstreamLink
from weightserver.storage.store import Commit, Upload, Version, VersionStore
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

# The health service name whose status says whether the upstream answers.
RELAY_HEALTH_SERVICE = "weightserver.relay"
# A follower's waits after a failure: doubling from the first to the last, with jitter.
BACKOFF_FIRST_SECONDS = 0.1
BACKOFF_MAX_SECONDS = 5.0
# How long a follower that reached a group version waits for the followers of the group's
# other models to reach it; then it commits its own model alone.
GROUP_WAIT_SECONDS = 60.0
# Publishes received early at once, awaiting their commit; beyond, the oldest are let go.
MAX_EARLY = 8
# Versions a relay cannot hold whatever it tries: logged and skipped.
_NEVER_FITS = (ModelTooLarge, DescriptionTooLarge, InvalidSafetensors)
# The upstream's answers that refuse this relay itself (its credentials), not a call.
_REFUSALS = (AuthenticationRequired, PermissionDenied)
# The calls that would change versions, refused on a relay.
_CHANGES = {"Publish": "publishes", "Negotiate": "publishes", "DeleteVersion": "deletes", "PinVersion": "pins"}


@dataclass
class _GroupCommit:
    """A group version that the followers of its models reach one by one."""

    waiting: set[str]  # the members whose followers have not reached it yet
    done: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Subscription:
    """One Watch on the upstream, as far as its events went: what a missed version is told by."""

    last: int  # the newest version announced (at first: the `since` subscribed with)
    gap: bool = False  # the upstream said versions after `since` are gone


@dataclass
class _Early:
    """A publish's bytes received from the upstream while they arrive there (cut-through),
    passed on to this relay's own followers as they land (`arriving`)."""

    arriving: IncomingPublish
    buffer: memoryview
    task: asyncio.Task[None]


class Relay:
    """Follows `upstream` into `store`, on the running event loop, from `start()` to `stop()`.

    `models`: the models to follow (None: every model the upstream has, including later ones).
    `health`: the server's health servicer, for the `weightserver.relay` status.
    `incoming`: the server's publishes-as-they-arrive (cut-through): with it, the relay receives
    each publish's bytes while they arrive upstream and passes them on to its own followers as
    they land, so that depth adds about a chunk's latency, not a transfer; it commits them once
    the upstream's commit names them and they match.
    `link`: how to dial the upstream (TLS, bearer token); default plaintext without a token.
    """

    def __init__(
        self,
        store: VersionStore,
        upstream: str,
        *,
        models: Sequence[str] | None = None,
        poll_seconds: float = 2.0,
        metrics: NoMetrics | None = None,
        health: health_aio.HealthServicer | None = None,
        incoming: IncomingPublishes | None = None,
        link: UpstreamLink | None = None,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.on_removed = on_removed  # called with the model after a version went (on the event loop)
        self.link = link or UpstreamLink()
        self.incoming = incoming
        self._early: dict[str, _Early] = {}  # by the upstream's announcement id
        self.address = upstream
        self.models = None if models is None else frozenset(validate_model_name(m) for m in models)
        self.poll_seconds = poll_seconds
        self.metrics = metrics or NoMetrics()
        self.health = health
        self.upstream_up: bool | None = None  # None until the first call answered or failed
        self.upstream_refused = False  # the upstream refuses this relay's credentials (as last heard)
        self.upstream_error: str | None = None  # why the upstream is away or refuses, while it is
        self.upstream_latest: dict[str, int] = {}  # model -> the upstream's newest version, as last heard
        self._client: UpstreamClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # "" polls, each model's follows it
        self._groups: dict[int, _GroupCommit] = {}
        self._upstream_back = asyncio.Event()  # set (and replaced) when the upstream answers again
        # model -> the upstream's summary (latest, count, bytes) when its versions were last
        # listed, and the versions this relay held then that the upstream retained.
        self._checked: dict[str, tuple[tuple[int, int, int], frozenset[int]]] = {}

    @property
    def followed(self) -> list[str]:
        """The models this relay follows now, sorted."""
        return sorted(name for name in self._tasks if name)

    @property
    def primary(self) -> str:
        """The address of the primary: the upstream's own primary when it is a relay."""
        named = self._client.primary if self._client is not None else None
        return named or self.address

    def watch_metadata(self) -> tuple[tuple[str, str], ...]:
        """Initial metadata of the Watch calls this relay serves: the primary, for relays below."""
        return ((PRIMARY_METADATA_KEY, self.primary),)

    def refuse(self, call: str) -> NoReturn:
        """Raise NotPrimary for a call that would change versions (`_CHANGES`)."""
        raise NotPrimary(
            f"this server is a relay of {self.address} and takes no {_CHANGES.get(call, 'changes')}: its versions "
            f"are the primary's; send publishes, deletes and pins to the primary, {self.primary}"
        )

    async def start(self, client_id: str | None = None) -> None:
        """Start following; `client_id` names this relay to its upstream (logs, per-client metrics)."""
        self._client = UpstreamClient(self.address, client_id, self.link)
        self.metrics.upstream_up(False)
        if self.health is not None:  # until the upstream first answers
            await self.health.set(RELAY_HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._tasks[""] = asyncio.create_task(self._poll(), name="weightserver-relay-poll")
        for model in sorted(self.models or ()):
            self._follow(model)
        log.info(
            "relaying %s (models: %s; polled every %gs; %s, %s)",
            self.address,
            ", ".join(sorted(self.models)) if self.models is not None else "all",
            self.poll_seconds,
            "TLS" if self.link.tls else "plaintext",
            "with a token" if self.link.token else "no token",
        )
        if self.link.token and not self.link.tls:
            log.warning(
                "relay: the upstream token travels in plaintext to %s; dial it over TLS (--upstream-tls-ca) "
                "unless the network between them is private",
                self.address,
            )

    async def stop(self) -> None:
        """Stop following; a commit under way finishes first."""
        tasks = list(self._tasks.values()) + [early.task for early in self._early.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    # ------------------------------------------------------------------ the upstream's models
    def _follows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def _follow(self, model: str) -> None:
        if model not in self._tasks:
            self._tasks[model] = asyncio.create_task(self._follower(model), name=f"weightserver-relay-{model}")

    async def _poll(self) -> None:
        """Ask the upstream for its models every `poll_seconds`: a new one is followed (when all
        are), and the answer (or its absence) says whether the upstream is up."""
        assert self._client is not None
        refusals = 0  # in a row: the poll backs off while the upstream refuses this relay
        while True:
            try:
                summaries = await self._client.list_models()
            except WeightServerError as exc:
                await self._report(False, exc)
            except Exception as exc:
                log.exception("polling the upstream %s failed", self.address)
                await self._report(False, exc)
            else:
                await self._report(True)
                for summary in summaries:
                    if self._follows(summary.model):
                        self._heard(summary.model, summary.latest_version, exact=True)
                        self._follow(summary.model)
                try:
                    await self._reconcile(summaries)
                except WeightServerError as exc:  # the upstream went away meanwhile: the next poll
                    log.info("relay: checking the versions held against %s failed: %s", self.address, exc)
            refusals = refusals + 1 if self.upstream_refused else 0
            await asyncio.sleep(max(self.poll_seconds, _backoff_seconds(refusals - 1) if refusals else 0.0))

    def _heard(self, model: str, version: int, *, exact: bool = False) -> None:
        """The upstream's latest version of `model` is `version` (`exact`), or at least that."""
        latest = version if exact else max(version, self.upstream_latest.get(model, 0))
        self.upstream_latest[model] = latest
        self.metrics.upstream_latest(model, latest)

    async def _report(self, up: bool, error: BaseException | None = None) -> None:
        """Record whether the upstream answers, and if not whether it refuses this relay: health,
        metrics, one log line per change; when it answers again, followers waiting to retry go
        at once."""
        refused = not up and isinstance(error, _REFUSALS)
        if refused:
            self.metrics.upstream_refusal()
        if not up:
            self.upstream_error = f"{type(error).__name__}: {error}" if error is not None else "no answer"
        if up == self.upstream_up and refused == self.upstream_refused:
            return
        self.upstream_up, self.upstream_refused = up, refused
        self.metrics.upstream_up(up, refused=refused)
        if up:
            self.upstream_error = None
            log.info("upstream %s answers: following it", self.address)
            self._upstream_back.set()
            self._upstream_back = asyncio.Event()
        elif refused:
            log.error(
                "upstream %s refuses this relay (%s): %s; serving the versions held, retrying with backoff",
                self.address,
                self.upstream_error,
                self._refusal_advice(),
            )
        else:
            log.warning(
                "upstream %s does not answer (%s): serving the versions held, retrying%s",
                self.address,
                error,
                self._handshake_advice(),
            )
        # Health last: a probe that sees it change finds the metrics and the log line in place.
        if self.health is not None:
            status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(RELAY_HEALTH_SERVICE, status)

    def _refusal_advice(self) -> str:
        """What to set when the upstream refuses this relay's token."""
        if not self.link.token:
            return (
                "it requires a token: give the relay one with --upstream-token-file FILE or "
                "$WEIGHTSERVER_UPSTREAM_TOKEN (an entry of the upstream's --auth-tokens file, role reader)"
            )
        return (
            "check the token of --upstream-token-file or $WEIGHTSERVER_UPSTREAM_TOKEN against the "
            "upstream's --auth-tokens file: it must be listed there, with role reader or above"
        )

    def _handshake_advice(self) -> str:
        """What to check when the upstream is unreachable: maybe TLS is the cause."""
        if self.link.tls:
            return (
                " (if it is up, the TLS handshake may be what fails: --upstream-tls-ca must be the CA that "
                "signed its certificate, which must name the address dialled; an upstream with "
                "--tls-client-ca also needs --upstream-tls-cert and --upstream-tls-key)"
            )
        return " (if it is up and serves TLS, dial it with --upstream-tls-ca PEM or --upstream-tls)"

    # ------------------------------------------------------------------ deletes upstream
    async def _reconcile(self, summaries: Sequence[pb.ModelSummary]) -> None:
        """Drop every version this relay holds that its upstream no longer retains: deleted
        there, or evicted. Called after each poll's ListModels (`summaries`), so a delete
        reaches the relay within a poll interval; at start, the first poll drops what the
        upstream deleted while the relay was down.

        Each version held is checked against the upstream's ListVersions, only for a model
        whose summary changed since it was last listed (the same latest version, count and
        bytes mean the same versions: new ones are numbered above the latest), and only
        versions this relay got since then otherwise; one missing there is dropped once
        Describe confirms it is gone (not merely committed after the listing)."""
        assert self._client is not None
        listed = {s.model: (s.latest_version, s.version_count, s.retained_bytes) for s in summaries}
        for model in [info.model for info in self.store.models()]:
            held = {v.version for v in self._held_versions(model)}
            summary = listed.get(model)
            checked = self._checked.get(model)
            if summary is not None and checked is not None and checked[0] == summary:
                retained = checked[1]
            elif summary is None:  # the upstream holds no version of it
                retained = frozenset()
            else:
                retained = frozenset(v.version for v in await self._upstream_versions(model))
            confirmed = held & retained
            for version in sorted(held - retained):
                try:
                    await self._client.describe(model, version)
                except VersionEvicted:
                    await self._drop(model, version, evicted=True)
                except NotFoundError:  # deleted (or the model is gone)
                    await self._drop(model, version, evicted=False)
                else:
                    confirmed.add(version)  # committed upstream after its listing
            if summary is None:
                self._checked.pop(model, None)
            else:
                self._checked[model] = (summary, frozenset(confirmed))

    def _held_versions(self, model: str) -> list[Version]:
        try:
            return self.store.versions(model)
        except ModelNotFound:
            return []

    async def _upstream_versions(self, model: str) -> list[pb.VersionInfo]:
        try:
            return await self._client.list_versions(model) if self._client is not None else []
        except ModelNotFound:
            return []

    async def _drop(self, model: str, version: int, *, evicted: bool) -> None:
        """Stop serving a version the upstream no longer retains."""
        try:
            await asyncio.to_thread(self.store.delete, model, version, evicted=evicted)
        except NotFoundError:
            return  # gone meanwhile (this relay's own retention)
        if self.on_removed is not None:
            self.on_removed(model)
        why = "evicted" if evicted else "deleted"
        log.info("relay of %r: v%d was %s upstream; no longer served here", model, version, why)

    # ------------------------------------------------------------------ following one model
    def _held(self, model: str) -> Version | None:
        try:
            return self.store.latest(model)
        except ModelNotFound:
            return None

    def _held_version(self, model: str) -> int:
        held = self._held(model)
        return held.version if held is not None else 0

    async def _follower(self, model: str) -> None:
        """Watch `model` on the upstream since the newest version held, and relay each version
        announced; after a failure, back off and resubscribe."""
        assert self._client is not None
        attempt, failure = 0, ""

        async def subscribed() -> None:
            nonlocal attempt, failure
            attempt, failure = 0, ""
            await self._report(True)

        while True:
            try:
                since = self._held_version(model)
                subscription = _Subscription(since)
                watch = self._client.watch(model, since, subscribed, incoming=bool(self.incoming))
                async for event in watch:
                    await self._on_event(model, event, subscription)
                continue  # the Watch's deadline passed: resubscribe at once
            except (ServerUnavailable, DeadlineExceeded, *_REFUSALS) as exc:
                await self._report(False, exc)
            except WeightServerError as exc:  # logged once while it repeats (e.g. CursorOutOfRange)
                repeated, failure = failure == str(exc), str(exc)
                log.log(
                    logging.DEBUG if repeated else logging.WARNING,
                    "relay of %r: %s: %s; retrying",
                    model,
                    type(exc).__name__,
                    exc,
                )
            except Exception:
                log.exception("relay of %r failed; retrying", model)
            await self._backoff(attempt)
            attempt += 1

    async def _backoff(self, attempt: int) -> None:
        with contextlib.suppress(asyncio.TimeoutError):  # else woken: the upstream answers again
            await asyncio.wait_for(self._upstream_back.wait(), _backoff_seconds(attempt))

    async def _on_event(self, model: str, event: pb.VersionEvent, subscription: _Subscription) -> None:
        if not event.HasField("version"):
            self._on_arriving(model, event.incoming)
            return
        number = event.version.version
        early = self._early.pop(event.incoming.id, None) if event.incoming.id else None
        self._heard(model, number)
        if event.gap:
            subscription.gap = True
            log.warning(
                "relay of %r: versions before v%d were evicted or deleted upstream before this relay fetched them",
                model,
                number,
            )
        after, subscription.last = subscription.last, number
        if subscription.gap and number > after + 1 and number > self._held_version(model):
            # Versions between are gone upstream, their numbers unsaid (numbers need not be
            # consecutive, so only after the upstream flagged a gap is a jump taken for one):
            # this relay's watchers after `after` are told of the gap with this version.
            self.store.missed(model, number - 1)
        if number <= self._held_version(model):
            if early is not None:
                early.arriving.fail("this relay holds that version already")
            return  # committed already, with its group
        members = [m for m in event.version.group if self._follows(m)]
        if early is not None:
            if len(members) <= 1 and await self._relay_early(model, event.version, early):
                return
            early.arriving.fail("the relay fetches this version again after its commit")
        if len(members) > 1:
            await self._reach_group(model, members, number)
        else:
            await self._relay([model], number)

    async def _reach_group(self, model: str, members: list[str], number: int) -> None:
        """`model`'s follower reached group version `number`: the last of `members` to reach it
        fetches and commits every member's version together; the others wait for it."""
        for member in members:
            self._follow(member)  # a group may name a model the poll has not listed yet
        group = self._groups.get(number)
        if group is None:  # members committed already (alone, after a wait that timed out) are not waited for
            group = self._groups[number] = _GroupCommit({m for m in members if self._held_version(m) < number})
        group.waiting.discard(model)
        if not group.waiting:
            committed = False
            try:
                await self._relay([m for m in members if self._held_version(m) < number], number)
                committed = True
            finally:
                self._groups.pop(number, None)
                group.done.set_result(committed)
            return
        try:
            committed = await asyncio.wait_for(asyncio.shield(group.done), GROUP_WAIT_SECONDS)
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on
            log.warning(
                "relay of %r v%d: the followers of %s did not reach this group version within %gs; committing it alone",
                model,
                number,
                ", ".join(sorted(group.waiting)),
                GROUP_WAIT_SECONDS,
            )
            if self._groups.get(number) is group:
                del self._groups[number]
            await self._relay([model], number)
            return
        if not committed:
            raise ServerUnavailable(f"the group commit of v{number} failed; {model!r} resubscribes")

    # ------------------------------------------------------------------ cut-through
    def _on_arriving(self, model: str, announced: pb.IncomingPublish) -> None:
        """The upstream announced a publish's bytes arriving (or, `failed`, never to commit):
        receive them, announcing them to this relay's own followers as they land."""
        if self.incoming is None or self._client is None:
            return
        if announced.failed:
            early = self._early.pop(announced.id, None)
            if early is not None:
                early.task.cancel()
                early.arriving.fail("the publish failed upstream")
            return
        if announced.id in self._early or not announced.byte_size:
            return
        while len(self._early) >= MAX_EARLY:  # commits that never came (the upstream restarted)
            stale = self._early.pop(next(iter(self._early)))
            stale.task.cancel()
            stale.arriving.fail("its commit never came from the upstream")
        # Anonymous memory: committed page by page as the bytes land.
        buffer = memoryview(mmap.mmap(-1, announced.byte_size))
        arriving = self.incoming.start(model, buffer)
        task = asyncio.create_task(
            self._receive_early(model, announced.id, arriving), name=f"weightserver-early-{model}"
        )
        self._early[announced.id] = _Early(arriving, buffer, task)

    async def _receive_early(self, model: str, upstream_id: str, arriving: IncomingPublish) -> None:
        assert self._client is not None
        try:
            await self._client.receive_arriving(model, upstream_id, arriving.buffer, arriving.advance)
        except BaseException as exc:
            arriving.fail(f"the relay's transfer from its upstream stopped: {str(exc) or type(exc).__name__}")
            raise

    async def _relay_early(self, model: str, info: pb.VersionInfo, early: _Early) -> bool:
        """Commit the version the upstream just committed from the bytes received early, if
        they all came and the store finds them to be that version (size, xxh3); False if not
        (the caller fetches it)."""
        try:
            await early.task
        except (asyncio.CancelledError, Exception) as exc:
            log.info("relay of %r v%d: receiving it early failed (%s); fetching it", model, info.version, exc)
            return False
        fetched = FetchedVersion(info, early.buffer, moved=early.buffer.nbytes, delta=False)

        def committed(record: Version) -> None:  # under the commit lock: this relay's events name the bytes
            assert self.incoming is not None
            self.incoming.committed(early.arriving, record.model, record.version)

        try:
            await self._commit_fetched([fetched], info.version, time.perf_counter(), on_commit=committed)
        except IntegrityError as exc:
            log.warning(
                "relay of %r v%d: the bytes received early are not it (%s); fetching it", model, info.version, exc
            )
            return False
        return early.arriving.ended and early.arriving.failure is None

    # ------------------------------------------------------------------ fetch and commit
    async def _relay(self, models: list[str], number: int) -> None:
        """Fetch version `number` of `models` and commit them (together)."""
        assert self._client is not None
        started = time.perf_counter()
        fetched: list[FetchedVersion] = []
        for model in models:
            try:
                fetched.append(await self._client.fetch_version(model, number, self._held(model)))
            except NotFoundError as exc:  # evicted or deleted upstream since it was announced
                log.warning("relay of %r v%d: gone upstream before it was fetched (%s)", model, number, exc)
                self.store.missed(model, number)  # this relay's watchers are told of the gap
        if fetched:
            await self._commit_fetched(fetched, number, started)

    async def _commit_fetched(
        self,
        fetched: list[FetchedVersion],
        number: int,
        started: float,
        on_commit: Callable[[Version], None] | None = None,
    ) -> None:
        """Commit the fetched versions together under `number`, with the upstream's metadata,
        digests and commit time; log and count them.

        They are counted in the commit itself, before any reader can see them: a client that
        sees a version and then reads /metrics finds its bytes counted."""

        def counted(commit: Commit) -> None:
            for f, record in zip(fetched, commit.versions, strict=True):
                if on_commit is not None:
                    on_commit(record)
                self.metrics.relayed(record.model, f.moved, delta=f.delta)
                self.metrics.published(record.model, record.byte_size, time.perf_counter() - started)

        uploads = [
            Upload(
                f.info.model,
                f.data,
                sha256=f.info.sha256 or None,
                xxh3=f.info.xxh3,
                total_bytes=f.info.byte_size,
                metadata=dict(f.info.metadata),
            )
            for f in fetched
        ]
        created = fetched[0].info.created.ToNanoseconds() / 1e9
        try:
            records = await self._commit(uploads, number, created, counted)
        except VersionConflict:
            return  # committed meanwhile (a group's other follower)
        except _NEVER_FITS as exc:
            log.error("relay of %s v%d: cannot hold it, skipped: %s", [f.info.model for f in fetched], number, exc)
            for f in fetched:
                self.store.missed(f.info.model, number)
            return
        seconds = time.perf_counter() - started
        for f, record in zip(fetched, records, strict=True):
            fields = {
                "event": "relay",
                "model": record.model,
                "version": record.version,
                "bytes": f.moved,
                "payload": "delta" if f.delta else "whole",
                "duration_ms": round(seconds * 1e3, 3),
            }
            pairs = " ".join(f"{key}={value}" for key, value in fields.items() if key != "event")
            log.info("relay %s upstream=%s", pairs, self.address, extra=fields)

    async def _commit(
        self, uploads: list[Upload], number: int, created: float, durable: Callable[[Commit], None]
    ) -> list[Version]:
        """Commit in a worker thread (it hashes and may fsync), calling `durable` before the
        versions are visible; a cancelled caller (the relay stopping) waits for it to finish."""

        def publish() -> list[Version]:
            with self.store.commit(uploads, version=number, created=created) as commit:
                durable(commit)
            return list(commit.versions)

        committing = asyncio.get_running_loop().run_in_executor(None, publish)
        try:
            return await asyncio.shield(committing)
        finally:
            await asyncio.wait([committing])


def _backoff_seconds(attempt: int) -> float:
    """The wait before retry `attempt` (0-based): doubling from the first to the last, with jitter."""
    return min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2**attempt) * (0.5 + random.random())
