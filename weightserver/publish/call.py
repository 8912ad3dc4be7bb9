"""A Publish call: per model a header, then chunks or a staged upload's id, then one commit message.

Commits run in threads of their own, so that no backlog of casts and deltas queues before them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from weightserver.protocol.errors import DeadlineExceeded, IntegrityError, InvalidRequest, clipped_message, clipped_repr
from weightserver.publish.incoming import IncomingPublishes
from weightserver.publish.priority import PublishTurn
from weightserver.publish.receiver import IncomingModel
from weightserver.publish.staged_uploads import StagedUploads
from weightserver.storage.store import Upload, Version, VersionStore
from weightserver.transports.shared_memory import SharedMemoryFiles
from weightserver.v1 import weights_pb2 as pb

PUBLISH_THREADS = 4  # threads that verify and commit publishes (hash, parse, fsync)
NO_HEADER = "a Publish stream must start with a header message (model, total_bytes, sha256)"
BYTES_TWICE = "a model's bytes come as chunks or one `uploaded`"


class Publishes:
    """What every Publish call into `store` shares."""

    def __init__(
        self,
        store: VersionStore,
        shared_memory: SharedMemoryFiles | None,
        announcements: IncomingPublishes,
        staged: StagedUploads,
        timeout: float | None,
    ) -> None:
        self.store, self.shared_memory, self.announcements = store, shared_memory, announcements
        self.staged, self.timeout = staged, timeout
        self.threads = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="weightserver-publish")

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)

    def check(self, header: pb.PublishHeader, first: pb.PublishHeader | None = None) -> None:
        """The store's checks of a header before its bytes; version and publish id are the `first`'s."""
        first = first or header
        self.store.check_publish(
            header.model,
            total_bytes=header.total_bytes,
            version=first.version,
            metadata=header.metadata,
            publish_id=first.publish_id,
        )


class PublishCall:
    """One Publish call; `owner` may name only the uploads it set up. Phases: receive, verify, commit (s)."""

    def __init__(
        self, publishes: Publishes, turn: PublishTurn, owner: bytes | None, counted: Callable[[Version], None]
    ) -> None:
        self.publishes, self.turn, self.owner, self.counted = publishes, turn, owner, counted
        self.models: list[IncomingModel] = []
        self.records: list[Version] = []
        self.receive = self.verify = self.commit = 0.0

    @property
    def repeat(self) -> bool:
        return not self.models[0].committed

    async def run(self, messages: AsyncIterator[pb.PublishRequest]) -> None:
        started, models = time.perf_counter(), self.models
        failure = "the publish stream ended without committing"
        try:
            seconds = self.publishes.timeout  # a stalled publisher must not hold its buffer forever
            try:
                async with asyncio.timeout(seconds):
                    commit = await self._read(messages)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"the publish stream took longer than the server's limit of {seconds:g}s and was dropped (nothing "
                    "was published); raise `weightserver serve --publish-timeout` for larger models or slower links"
                ) from None
            self.receive = time.perf_counter() - started
            sha256s = _declared_sha256s(models, commit)
            loop = asyncio.get_running_loop()
            digests = [await loop.run_in_executor(self.publishes.threads, m.finish) for m in models]
            self.verify = time.perf_counter() - started - self.receive
            uploads = [m.as_upload(s, d) for m, s, d in zip(models, sha256s, digests, strict=True)]
            self.records = await self._commit(uploads)
            self.commit = time.perf_counter() - started - self.receive - self.verify
            failure = "a repeat of a publish id committed before: its version was announced then"
        except BaseException as exc:
            failure = clipped_message(str(exc) or type(exc).__name__, 200)
            raise
        finally:
            for model in models:
                model.discard(failure)

    async def _read(self, messages: AsyncIterator[pb.PublishRequest]) -> pb.PublishCommit:
        models, turn, commit = self.models, self.turn, None
        async for message in messages:
            kind = message.WhichOneof("kind")
            if commit is not None:
                raise InvalidRequest(f"model {models[0].model!r}: nothing may follow the commit message")
            if kind == "header":
                self._header(message.header)
                turn.header()
            elif not models:
                raise InvalidRequest(NO_HEADER)
            elif kind == "chunk":
                turn.chunk()
                models[-1].add(message.chunk)
            elif kind == "written":  # keeps the header's hold: a same-host writer's pace is a memory copy
                self._staged(message.written.upload, "`written` after another upload or its `uploaded`")
                models[-1].written(message.written.end)
                turn.written()
            elif kind == "uploaded":
                self._staged(message.uploaded.upload, BYTES_TWICE)
                models[-1].uploaded(message.uploaded)
                turn.uploaded()
            elif kind == "commit":
                models[-1].check_complete()
                commit = message.commit
                turn.bytes_in()
            else:
                raise InvalidRequest(f"model {models[-1].model!r}: unexpected {kind!r} message")
        if not models:
            raise InvalidRequest(NO_HEADER)
        if commit is None:
            models[-1].check_complete()
            raise InvalidRequest(
                f"model {', '.join(repr(m.model) for m in models)}: the publish stream ended without a commit "
                "message, so nothing was published (the publisher was cancelled or failed before finishing)"
            )
        return commit

    async def _commit(self, uploads: list[Upload]) -> list[Version]:
        committing = asyncio.get_running_loop().run_in_executor(self.publishes.threads, self._commit_now, uploads)
        try:
            return await asyncio.shield(committing)
        finally:
            # A call cancelled meanwhile leaves the commit running: it finishes with the uploads
            # before they are let go, and a retry with the same publish id finds its version.
            await asyncio.wait([committing])

    def _commit_now(self, uploads: list[Upload]) -> list[Version]:
        """Each model's version is counted and adopted in the commit's first phase (durable, not yet visible)."""
        first = self.models[0].header
        with self.publishes.store.commit(uploads, version=first.version, publish_id=first.publish_id) as commit:
            if not commit.replayed:
                for model, record in zip(self.models, commit.versions, strict=True):
                    self.counted(record)
                    model.adopt(record)
        return list(commit.versions)

    def _header(self, header: pb.PublishHeader) -> None:
        models, publishes = self.models, self.publishes
        if any(m.model == header.model for m in models):
            raise InvalidRequest(f"model {header.model!r} appears twice in one publish")
        first = models[0].header if models else header
        if models:
            models[-1].check_complete()
        if header.version and header.version != first.version:
            raise InvalidRequest(
                f"model {clipped_repr(header.model)}: a multi-model publish has one version number; this header asks "
                f"for {header.version} but the first asks for {first.version or 'the next one'} (leave later ones 0)"
            )
        if header.publish_id and header.publish_id != first.publish_id:
            raise InvalidRequest(
                f"model {header.model!r}: a multi-model publish has one publish id, the first header's; this "
                f"header gives {header.publish_id!r} (leave later ones empty)"
            )
        publishes.check(header, first)
        limits, memory, announcements = publishes.store.header_limits, publishes.shared_memory, publishes.announcements
        models.append(IncomingModel(header, shared_memory=memory, header_limits=limits, announcements=announcements))

    def _staged(self, upload: str, out_of_order: str) -> None:
        model = self.models[-1]
        if model.transport == "stream":
            if model.received:
                raise InvalidRequest(f"model {model.model!r}: {BYTES_TWICE}")
            staged = self.publishes.staged.take(upload, model.model, model.total_bytes, owner=self.owner)
            staged.header = model.header
            self.models[-1] = staged
        elif upload != model.id or model.moved:
            raise InvalidRequest(f"model {model.model!r}: {out_of_order}")


def _declared_sha256s(models: list[IncomingModel], commit: pb.PublishCommit) -> list[str | None]:
    """Each model's sha256 from its header or the commit; None where only an xxh3 is."""
    from_commit = list(commit.sha256)
    if from_commit and len(from_commit) != len(models):
        raise InvalidRequest(
            f"the commit carries {len(from_commit)} sha256 digests for {len(models)} models; give one per header"
        )
    digests = []
    for i, model in enumerate(models):
        in_header, in_commit = model.header.sha256, from_commit[i] if from_commit else ""
        if not in_header and not in_commit and not model.header.xxh3:
            raise InvalidRequest(
                f"model {model.model!r}: give the xxh3 of the bytes in the header, or their sha256 in the "
                "header or the commit"
            )
        if in_header and in_commit and in_header.lower() != in_commit.lower():
            raise IntegrityError(
                f"model {model.model!r}: header declares sha256 {clipped_repr(in_header)} but the commit "
                f"declares {clipped_repr(in_commit)}"
            )
        digests.append(in_header or in_commit or None)
    return digests
