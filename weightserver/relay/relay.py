"""Relay (`serve --upstream ADDRESS`): a server that follows another as its client, committing each
version announced under the upstream's number, metadata, digests and commit time."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from weightclient.core.retry import RetryPolicy
from weightclient.core.service_client import WeightServiceClient
from weightserver.config import ServerConfig
from weightserver.metrics import NoMetrics
from weightserver.protocol import errors, page_tables
from weightserver.protocol.channel import channel_credentials
from weightserver.protocol.digests import FileDigests, xxh3_hex
from weightserver.protocol.limits import MAX_CHUNK_BYTES
from weightserver.protocol.names import validate_model_name
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.version_info import IncomingEvent, ModelSummary, VersionEvent, VersionInfo
from weightserver.publish.incoming import IncomingPublish, IncomingPublishes
from weightserver.storage.store import Upload, Version, VersionStore

log = logging.getLogger(__name__)
T = TypeVar("T")

RELAY_HEALTH_SERVICE = "weightserver.relay"
# Initial metadata of a relay's Watch: the primary, so a relay of a relay names the tree's root.
PRIMARY_METADATA_KEY = "weightserver-primary"
# Deadlines: a unary call; a Watch (then resubscribed, so a silent upstream is asked again); each wait
# for a transfer's bytes (a fetch runs as long as they keep coming: at a publisher's pace, or a slow link's).
CALL_SECONDS = 5.0
WATCH_SECONDS = 60.0
STALL_SECONDS = 60.0
BACKOFF = RetryPolicy(first=0.1, longest=5.0)  # after a failure; the poll's while the upstream refuses
GROUP_WAIT_SECONDS = 60.0  # for the other members of a group version; then a follower commits alone
MAX_INCOMING = 8  # publishes received early, awaiting their commit; beyond, the oldest are let go
_NEVER_FITS = (errors.ModelTooLarge, errors.DescriptionTooLarge, errors.InvalidSafetensors)
_REFUSALS = (errors.AuthenticationRequired, errors.PermissionDenied)


def check_upstream_tls(config: ServerConfig) -> None:
    """Read the upstream's PEM files now, so that a bad one stops the server before it binds (ValueError)."""
    if config.upstream_uses_tls:
        files = (config.upstream_tls_ca, config.upstream_tls_cert, config.upstream_tls_key)
        try:
            channel_credentials(*files, names=("--upstream-tls-ca", "--upstream-tls-cert", "--upstream-tls-key"))
        except OSError as exc:
            raise ValueError(f"cannot read the upstream's TLS file {exc.filename}: {exc.strerror}") from None


@dataclass
class _GroupCommit:
    waiting: set[str]  # the members whose followers have not reached the group version yet
    done: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Incoming:  # a publish's bytes received while they arrive upstream, passed on as they land
    publish: IncomingPublish
    task: asyncio.Task[None]


@dataclass(frozen=True)
class _Fetched:
    info: VersionInfo
    data: bytes | bytearray | memoryview = field(repr=False)
    moved: int  # payload bytes received: a delta's, or the whole file's (and a discarded delta's)
    delta: bool  # rebuilt from a delta against the version held
    checked: bool = True  # its xxh3 was checked against the announced one (bytes received early are not)

    def upload(self, header_limits: dict[str, int]) -> Upload:
        """Checked bytes (the xxh3 matched, or the upstream's sealed memfd) bring their digests, committed as
        declared: hashing 256 MiB again cost 80% of a relay's time; the pass after the commit checks the sha256."""
        info, found = self.info, None
        tensor_xxh3 = {t.name: t.xxh3 for t in info.tensors}
        if self.checked and info.xxh3 and all(tensor_xxh3.values()):
            header = parse_header(self.data, len(self.data), **header_limits)
            names = {t.name for t in header.tensors}
            found = FileDigests(info.xxh3, tensor_xxh3, header, declared=True) if names == tensor_xxh3.keys() else None
        return Upload(info.model, self.data, None, info.byte_size, dict(info.metadata), digests=found, xxh3=info.xxh3)


class Relay:
    """Follows `config.upstream` into `store` on the running event loop. `incoming`: the
    server's publishes in progress, fed as bytes arrive (cut-through) so depth is cheap."""

    def __init__(
        self,
        store: VersionStore,
        config: ServerConfig,
        *,
        metrics: NoMetrics,
        health: health_aio.HealthServicer,
        incoming: IncomingPublishes,
        on_removed: Callable[[str], None],
    ) -> None:
        assert config.upstream is not None
        self.store, self.config, self.incoming = store, config, incoming
        self.tls, self.token = config.upstream_uses_tls, config.upstream_token or ""  # "": none (not from the env)
        self.on_removed = on_removed  # called with the model after a version went (on the event loop)
        self._incoming: dict[str, _Incoming] = {}  # by the upstream's announcement id
        self.address, models = config.upstream, config.upstream_models  # models to follow (None: all)
        self.models = None if models is None else frozenset(validate_model_name(m) for m in models)
        self.poll_seconds = config.upstream_poll_seconds
        self.metrics, self.health = metrics, health
        self.upstream_up: bool | None = None  # None until the first call answered or failed
        self.upstream_refused = False  # the upstream refuses this relay's credentials (as last heard)
        self.upstream_error: str | None = None  # why the upstream is away or refuses, while it is
        self.upstream_latest: dict[str, int] = {}  # model -> the upstream's newest version, as last heard
        self._client: WeightServiceClient  # dialled by start()
        self._threads = ThreadPoolExecutor(64, thread_name_prefix="weightserver-relay")  # the client blocks
        self.primary = self.address  # the primary's address: the upstream's own primary when it is a relay
        self._tasks: dict[str, asyncio.Task[None]] = {}  # "" polls, each model's follows it
        self._groups: dict[tuple[int, frozenset[str]], _GroupCommit] = {}  # by number and members
        self._upstream_back = asyncio.Event()  # set (and replaced) when the upstream answers again
        # model -> the upstream's (latest, count, bytes) when last listed, and the versions held then that it retained
        self._checked: dict[str, tuple[tuple[int, int, int], frozenset[int]]] = {}

    @property
    def followed(self) -> list[str]:
        return sorted(name for name in self._tasks if name)

    @property
    def receiving(self) -> int:
        """Publishes whose bytes this relay holds or receives early, awaiting their commit upstream."""
        return len(self._incoming)

    def watch_metadata(self) -> tuple[tuple[str, str], ...]:
        """Initial metadata of the Watch calls this relay serves: the primary, for relays below."""
        return ((PRIMARY_METADATA_KEY, self.primary),)

    def refuse(self, changes: str) -> NoReturn:
        raise errors.NotPrimary(
            f"this server is a relay of {self.address} and takes no {changes}: its versions "
            f"are the primary's; send publishes, deletes and pins to the primary, {self.primary}"
        )

    async def start(self, client_id: str | None = None) -> None:
        """Start following; `client_id` names this relay to its upstream (logs, per-client metrics)."""
        config = self.config
        self._client = WeightServiceClient(
            self.address,
            timeout=CALL_SECONDS,
            chunk_bytes=MAX_CHUNK_BYTES,
            client_id=client_id,
            token=self.token,
            tls=self.tls,
            tls_ca=config.upstream_tls_ca,
            tls_cert=config.upstream_tls_cert,
            tls_key=config.upstream_tls_key,
        )
        self.metrics.upstream_up(False)
        await self.health.set(RELAY_HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # until it answers
        self._tasks[""] = asyncio.create_task(self._poll(), name="weightserver-relay-poll")
        for model in sorted(self.models or ()):
            self._follow(model)
        models = ", ".join(sorted(self.models)) if self.models is not None else "all"
        how = ("TLS" if self.tls else "plaintext", "with a token" if self.token else "no token")
        log.info("relaying %s (models: %s; polled every %gs; %s, %s)", self.address, models, self.poll_seconds, *how)
        if self.token and not self.tls:
            log.warning("relay: the upstream token travels in plaintext to %s; use --upstream-tls-ca", self.address)

    async def stop(self) -> None:
        """Stop following; a commit under way finishes first."""
        tasks = list(self._tasks.values()) + [incoming.task for incoming in self._incoming.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self._client.close)  # ends its calls still running in threads
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _blocking(self, call: Callable[..., T], *args: object, **kwargs: object) -> T:
        """`call` (the client's, which blocks) in this relay's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(call, *args, **kwargs))

    def _follows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def _follow(self, model: str) -> None:
        if model not in self._tasks:
            self._tasks[model] = asyncio.create_task(self._follower(model), name=f"weightserver-relay-{model}")

    async def _poll(self) -> None:
        """Every `poll_seconds` (longer while refused): follow new models, drop versions gone upstream, report."""
        refusals = 0  # in a row
        while True:
            try:
                summaries = await self._blocking(self._client.list_models)
            except Exception as exc:
                if not isinstance(exc, errors.WeightServerError):
                    log.exception("polling the upstream %s failed", self.address)
                await self._report(exc)
            else:
                await self._report(None)
                for summary in summaries:
                    if self._follows(summary.model):
                        self._heard(summary.model, summary.latest_version)
                        self._follow(summary.model)
                try:
                    await self._reconcile(summaries)
                except errors.WeightServerError as exc:  # the upstream went away meanwhile: the next poll
                    log.info("relay: checking the versions held against %s failed: %s", self.address, exc)
            refusals = refusals + 1 if self.upstream_refused else 0
            await asyncio.sleep(max(self.poll_seconds, BACKOFF.delay(refusals - 1) if refusals else 0.0))

    def _heard(self, model: str, latest: int) -> None:
        self.upstream_latest[model] = latest
        self.metrics.upstream_latest(model, latest)

    async def _report(self, error: BaseException | None) -> None:
        """Record whether the upstream answers (`error` None) or refuses: metrics, a log line per change, health."""
        up, refused = error is None, isinstance(error, _REFUSALS)
        if refused:
            self.metrics.upstream_refusal()
        self.upstream_error = None if error is None else f"{type(error).__name__}: {error}"
        if up == self.upstream_up and refused == self.upstream_refused:
            return
        self.upstream_up, self.upstream_refused = up, refused
        self.metrics.upstream_up(up, refused=refused)
        if up:
            log.info("upstream %s answers: following it", self.address)
            self._upstream_back.set()  # waiting followers go at once
            self._upstream_back = asyncio.Event()
        elif refused:
            advice = "check the token of" if self.token else "it requires a token: give the relay one with"
            message = "upstream %s refuses this relay (%s): %s --upstream-token-file or $WEIGHTSERVER_UPSTREAM_TOKEN"
            log.error(message + " (role reader or above)", self.address, self.upstream_error, advice)
        else:  # a failed TLS handshake looks like an upstream that is away (UNAVAILABLE)
            advice = "if it is up and serves TLS, dial it with --upstream-tls-ca PEM or --upstream-tls"
            if self.tls:
                advice = "if it is up, check its TLS: --upstream-tls-ca (its CA, the name dialled), --upstream-tls-cert"
            log.warning("upstream %s does not answer (%s): serving the versions held (%s)", self.address, error, advice)
        # Last: a probe that sees it change finds the rest in place.
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(RELAY_HEALTH_SERVICE, status)

    async def _reconcile(self, summaries: Sequence[ModelSummary]) -> None:
        """Drop the versions held that the upstream no longer retains (as Describe confirms); relist on a change."""
        listed = {s.model: (s.latest_version, s.version_count, s.retained_bytes) for s in summaries}
        for model in [info.model for info in self.store.models()]:
            summary, checked = listed.get(model), self._checked.pop(model, None)
            try:
                held = {v.version for v in self.store.versions(model)}
            except errors.ModelNotFound:
                continue  # gone meanwhile (this relay's own retention)
            retained: frozenset[int] = frozenset()  # when the upstream holds no version of it
            if checked is not None and checked[0] == summary:
                retained = checked[1]
            elif summary is not None:
                with contextlib.suppress(errors.ModelNotFound):
                    retained = frozenset(v.version for v in await self._blocking(self._client.list_versions, model))
            confirmed = held & retained
            for version in sorted(held - retained):
                try:
                    await self._blocking(self._client.describe, model, version)
                    confirmed.add(version)  # committed upstream after its listing
                except errors.NotFoundError as exc:  # evicted, deleted, or the model is gone
                    why = "evicted" if isinstance(exc, errors.VersionEvicted) else "deleted"
                    with contextlib.suppress(errors.NotFoundError):  # else gone meanwhile (this relay's retention)
                        await asyncio.to_thread(self.store.delete, model, version, evicted=why == "evicted")
                        self.on_removed(model)
                        log.info("relay of %r: v%d was %s upstream; no longer served here", model, version, why)
            if summary is not None:
                self._checked[model] = (summary, frozenset(confirmed))

    def _held(self, model: str) -> Version | None:
        with contextlib.suppress(errors.ModelNotFound):
            return self.store.latest(model)
        return None

    def _held_version(self, model: str) -> int:
        return getattr(self._held(model), "version", 0)

    async def _follower(self, model: str) -> None:
        """Watch `model` from the newest version held and relay each; after a failure, back off and resubscribe.
        The backoff grows until a version is relayed or a Watch runs its course (not merely subscribed:
        a commit that fails after each subscription, on a full disk, would refetch the version at once)."""
        attempt, failure = 0, ""

        def subscribed(metadata: dict[str, str]) -> None:
            self.primary = metadata.get(PRIMARY_METADATA_KEY) or self.address

        while True:
            last = self._held_version(model)  # the newest version announced
            events = self._client.watch(
                model, since=last, timeout=WATCH_SECONDS, incoming=True, on_subscribed=subscribed
            )
            try:
                while (event := await self._blocking(_next_event, events)) is not None:
                    if isinstance(event, IncomingEvent):
                        self._on_arriving(event)
                        continue
                    # Numbers need not be consecutive: only a jump to the event that flags a gap is one.
                    if event.gap and event.version > last + 1 and event.version > self._held_version(model):
                        self.store.missed(model, event.version - 1)
                    last = event.version
                    await self._on_event(model, event)
                    attempt, failure = 0, ""
                attempt = 0  # the Watch's deadline passed, with no failure: resubscribe at once
                continue
            except (errors.ServerUnavailable, errors.DeadlineExceeded, *_REFUSALS) as exc:
                await self._report(exc)
            except errors.WeightServerError as exc:  # logged once while it repeats (e.g. CursorOutOfRange)
                level, failure = (logging.DEBUG if failure == str(exc) else logging.WARNING), str(exc)
                log.log(level, "relay of %r: %s: %s; retrying", model, type(exc).__name__, exc)
            except Exception:
                log.exception("relay of %r failed; retrying", model)
            finally:
                with contextlib.suppress(ValueError):  # still stepping in a thread: stop()'s close ends it
                    events.close()
            await BACKOFF.wait_async(attempt, wake=self._upstream_back)
            attempt += 1

    async def _on_event(self, model: str, event: VersionEvent) -> None:
        number = event.version
        incoming = self._incoming.pop(event.incoming, None) if event.incoming else None
        self._heard(model, max(number, self.upstream_latest.get(model, 0)))
        if event.gap:
            log.warning("relay of %r: versions before v%d went upstream before this relay fetched them", model, number)
        if number <= self._held_version(model):
            if incoming is not None:
                incoming.publish.fail("this relay holds that version already")
            return  # committed already, with its group
        members = [m for m in event.info.group if self._follows(m)]
        if incoming is not None:
            if len(members) <= 1 and await self._relay_incoming(event.info, incoming):
                return
            incoming.publish.fail("the relay fetches this version again after its commit")
        if len(members) > 1:
            await self._reach_group(model, members, number)
        elif too_large := self._too_large(model, event.info.byte_size):
            log.error("relay of %r v%d: cannot hold it, skipped: %s", model, number, too_large)
            self.store.missed(model, number)
        else:
            await self._relay([model], number)

    async def _reach_group(self, model: str, members: list[str], number: int) -> None:
        """The last of `members`' followers to reach group version `number` commits them together."""
        for member in members:
            self._follow(member)  # a group may name a model the poll has not listed yet
        key = (number, frozenset(members))  # (other models may have published a group under the same number)
        group = self._groups.get(key)
        if group is None:  # members committed already (alone, after a wait that timed out) are not waited for
            group = self._groups[key] = _GroupCommit({m for m in members if self._held_version(m) < number})
        group.waiting.discard(model)
        if not group.waiting:
            committed = False
            try:
                await self._relay([m for m in members if self._held_version(m) < number], number)
                committed = True
            finally:
                self._groups.pop(key, None)
                group.done.set_result(committed)
            return
        try:
            committed = await asyncio.wait_for(asyncio.shield(group.done), GROUP_WAIT_SECONDS)
        except TimeoutError:
            waiting = ", ".join(sorted(group.waiting))
            log.warning("relay of %r v%d: %s did not reach it in time; committing it alone", model, number, waiting)
            if self._groups.get(key) is group:
                del self._groups[key]
            await self._relay([model], number)
            return
        if not committed:
            raise errors.ServerUnavailable(f"the group commit of v{number} failed; {model!r} resubscribes")

    def _too_large(self, model: str, byte_size: int) -> errors.ModelTooLarge | None:
        """Why this relay cannot hold `byte_size` bytes of `model` (--max-model-bytes), or None: none are fetched."""
        try:
            self.store.check_publish(model, total_bytes=byte_size)
        except errors.ModelTooLarge as exc:
            return exc
        return None

    def _on_arriving(self, announced: IncomingEvent) -> None:
        """A publish's bytes arrive upstream (or, `failed`, never will): receive them, passing them on as they land."""
        if announced.failed:
            if (incoming := self._incoming.pop(announced.id, None)) is not None:
                incoming.task.cancel()
                incoming.publish.fail("the publish failed upstream")
            return
        size = announced.byte_size
        if announced.id in self._incoming or not size or self._too_large(announced.model, size):  # (its commit says so)
            return
        while len(self._incoming) >= MAX_INCOMING:  # commits that never came (the upstream restarted)
            stale = self._incoming.pop(next(iter(self._incoming)))
            stale.task.cancel()
            stale.publish.fail("its commit never came from the upstream")
        publish = self.incoming.start(announced.model, page_tables.anonymous(announced.byte_size))
        task = asyncio.create_task(self._receive_incoming(announced, publish), name="weightserver-relay-incoming")
        self._incoming[announced.id] = _Incoming(publish, task)

    async def _receive_incoming(self, announced: IncomingEvent, publish: IncomingPublish) -> None:
        """The bytes into `publish.buffer`, unchecked: kept only if the commit names and matches them."""

        def progress(received: int, _: int) -> None:
            publish.advance(received)  # thread-safe

        try:
            await self._blocking(
                self._client.fetch_incoming, announced, timeout=STALL_SECONDS, into=publish.buffer, progress=progress
            )
        except BaseException as exc:
            # Not awaited by a commit yet: let go of the buffer now, as no commit may come (the upstream
            # died); a commit that names these bytes later fetches the version instead.
            unclaimed = isinstance(exc, Exception) and self._incoming.pop(announced.id, None) is not None
            publish.fail(f"the relay's transfer from its upstream stopped: {str(exc) or type(exc).__name__}")
            if not unclaimed:
                raise

    async def _relay_incoming(self, info: VersionInfo, incoming: _Incoming) -> bool:
        """Commit the version from the bytes received early; False (fetch it) if they are not all there or not it."""
        try:
            await incoming.task
        except (asyncio.CancelledError, Exception) as exc:
            log.info("relay of %r v%d: receiving it early failed (%s); fetching it", info.model, info.version, exc)
            return False
        buffer, started = incoming.publish.buffer, time.perf_counter()
        try:
            fetched = _Fetched(info, buffer, buffer.nbytes, delta=False, checked=False)
            await self._commit([fetched], info.version, started, incoming.publish)
        except errors.IntegrityError as exc:
            log.warning("relay of %r v%d: the bytes received early are not it (%s)", info.model, info.version, exc)
            return False
        except BaseException as exc:  # (a full disk): ended, so that its watchers are told and its buffer goes
            incoming.publish.fail(f"the relay could not commit them: {str(exc) or type(exc).__name__}")
            raise
        return incoming.publish.ended and incoming.publish.failure is None

    async def _relay(self, models: list[str], number: int) -> None:
        """Fetch version `number` of `models` and commit them together."""
        started = time.perf_counter()
        fetched: list[_Fetched] = []
        for model in models:
            try:
                fetched.append(await self._blocking(self._fetch, model, number, self._held(model)))
            except errors.NotFoundError as exc:  # evicted or deleted upstream since it was announced
                log.warning("relay of %r v%d: gone upstream before it was fetched (%s)", model, number, exc)
                self.store.missed(model, number)  # this relay's watchers are told of the gap
        if fetched:
            await self._commit(fetched, number, started)

    def _fetch(self, model: str, number: int, base: Version | None) -> _Fetched:
        """Version `number` of `model` (in a thread), rebuilt from a delta against `base` if that matches its xxh3."""
        fetch = functools.partial(
            self._client.fetch_bytes, model, version=number, timeout=STALL_SECONDS, stall=STALL_SECONDS, retry=False
        )
        sent = 0  # a delta's payload bytes
        if base is not None:
            try:  # (rebuilt on a copy of the base as it arrives)
                got = fetch(base_version=base.version, base_xxh3=base.xxh3, base_bytes=base.data)
                assert got is not None  # an exact version is never "up to date"
                if not got.base_version:
                    return _Fetched(got.info, got.data, got.data.nbytes, delta=False)
                sent = got.stats.wire_bytes if got.stats is not None else got.data.nbytes
                if got.changed is not None and xxh3_hex(got.data) == got.info.xxh3:
                    return _Fetched(got.info, got.data, sent, delta=True)
                why = "the layouts differ" if got.changed is None else "its xxh3 differs"
            except errors.IntegrityError as exc:
                why = str(exc)
            message = "%s v%d: the delta against v%d did not rebuild it (%s); fetching whole"
            log.info(message, model, number, base.version, why)
        got = fetch()
        assert got is not None
        return _Fetched(got.info, got.data, sent + got.data.nbytes, delta=False)

    async def _commit(
        self, fetched: list[_Fetched], number: int, started: float, publish: IncomingPublish | None = None
    ) -> None:
        """Commit `fetched` under `number` in a thread (it hashes) that a cancelled caller waits for; counted
        before it is visible, so a client that sees a version finds it in /metrics."""

        def commit() -> list[Version]:
            uploads = [f.upload(self.store.header_limits) for f in fetched]
            with self.store.commit(uploads, version=number, created=fetched[0].info.created_ns / 1e9) as done:
                for f, record in zip(fetched, done.versions, strict=True):
                    if publish is not None:  # this relay's events name the bytes
                        self.incoming.committed(publish, record.model, record.version)
                    self.metrics.relayed(record.model, f.moved, delta=f.delta)
                    self.metrics.published(record.model, record.byte_size, time.perf_counter() - started)
            return list(done.versions)

        committing = asyncio.get_running_loop().run_in_executor(None, commit)
        try:
            records = await asyncio.shield(committing)
        except errors.VersionConflict:
            return  # committed meanwhile (a group's other follower)
        except _NEVER_FITS as exc:
            log.error("relay of %s v%d: cannot hold it, skipped: %s", [f.info.model for f in fetched], number, exc)
            for f in fetched:
                self.store.missed(f.info.model, number)
            return
        finally:
            await asyncio.wait([committing])
        milliseconds = round((time.perf_counter() - started) * 1e3, 3)
        for f, record in zip(fetched, records, strict=True):
            fields = {"model": record.model, "version": record.version, "bytes": f.moved}
            fields.update(payload="delta" if f.delta else "whole", duration_ms=milliseconds)
            pairs = " ".join(f"{key}={value}" for key, value in fields.items())
            log.info("relay %s upstream=%s", pairs, self.address, extra={"event": "relay", **fields})


def _next_event(events: Iterator[VersionEvent | IncomingEvent]) -> VersionEvent | IncomingEvent | None:
    """The Watch's next event; None once it ended (its deadline passed: resubscribe)."""
    try:
        return next(events, None)
    except errors.DeadlineExceeded:
        return None
