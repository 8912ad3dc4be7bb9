"""Publishes: one Publish call's models read off its stream, verified and committed.

A call sends, per model, a header and then its bytes: chunks, or the id of an upload that
Negotiate staged (`written` as a same-host writer goes, `uploaded` once all are in); then one
commit message. The commit runs in threads of its own, so that no backlog of other work (casts,
deltas) queues in front of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weightserver.protocol.errors import DeadlineExceeded, IntegrityError, InvalidRequest, clipped_message, clipped_repr
from weightserver.publish.incoming import IncomingPublishes
from weightserver.publish.priority import PublishTurn
from weightserver.publish.receiver import IncomingModel
from weightserver.publish.staged_uploads import StagedUploads
from weightserver.storage.store import Version, VersionStore
from weightserver.transports.shared_memory import SharedMemoryFiles
from weightserver.v1 import weights_pb2 as pb

PUBLISH_THREADS = 4  # threads that verify and commit publishes (hash, parse, fsync)
NO_HEADER = "a Publish stream must start with a header message (model, total_bytes, sha256)"


@dataclass
class Published:
    """What one Publish call received and committed, and where its time went (seconds)."""

    models: list[IncomingModel] = field(default_factory=list)
    records: list[Version] = field(default_factory=list)
    receive: float = 0.0  # from the call's start until its commit message
    verify: float = 0.0  # until the digests of its bytes were in
    commit: float = 0.0  # the store's commit

    @property
    def repeat(self) -> bool:
        """A repeat of a publish id: `records` are what an earlier call committed."""
        return not self.models[0].committed


class Publishes:
    """Receives and commits Publish calls into `store`."""

    def __init__(
        self,
        store: VersionStore,
        *,
        shared_memory: SharedMemoryFiles | None,
        announcements: IncomingPublishes,
        staged: StagedUploads,
        timeout: float | None,
    ) -> None:
        self.store = store
        self.shared_memory = shared_memory
        self.announcements = announcements
        self.staged = staged
        self.timeout = timeout
        self._threads = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="weightserver-publish")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def check(self, header: pb.PublishHeader, first: pb.PublishHeader | None = None) -> None:
        """The store's checks of a model's header before any byte comes; the version number and
        publish id are the group's, from its `first` header."""
        first = first or header
        self.store.check_publish(
            header.model,
            total_bytes=header.total_bytes,
            version=first.version,
            metadata=header.metadata,
            publish_id=first.publish_id,
        )

    async def receive(
        self,
        messages: AsyncIterator[pb.PublishRequest],
        turn: PublishTurn,
        published: Published,
        *,
        owner: bytes | None,
        counted: Callable[[Version], None],
    ) -> None:
        """Receive the models of `messages` into `published`, then verify and commit them,
        telling `turn` what arrives. `owner` may name only the uploads it set up. Whatever
        does not commit is let go."""
        started, models = time.perf_counter(), published.models
        failure = "the publish stream ended without committing"
        try:
            commit = await self._read(messages, turn, models, owner, counted)
            published.receive = time.perf_counter() - started
            sha256s = _declared_sha256s(models, commit)
            digests = [await asyncio.to_thread(m.finish) for m in models]
            published.verify = time.perf_counter() - started - published.receive
            uploads = [m.as_upload(s, d) for m, s, d in zip(models, sha256s, digests, strict=True)]
            published.records = await self._commit(uploads, models[0].header)
            published.commit = time.perf_counter() - started - published.receive - published.verify
            failure = "a repeat of a publish id committed before: its version was announced then"
        except BaseException as exc:
            failure = clipped_message(str(exc) or type(exc).__name__, 200)
            raise
        finally:
            for model in models:
                model.discard(failure)

    async def _read(
        self,
        messages: AsyncIterator[pb.PublishRequest],
        turn: PublishTurn,
        models: list[IncomingModel],
        owner: bytes | None,
        counted: Callable[[Version], None],
    ) -> pb.PublishCommit:
        commit: pb.PublishCommit | None = None
        async for message in _within(messages, self.timeout):
            kind = message.WhichOneof("kind")
            if commit is not None:
                raise InvalidRequest(f"model {models[0].model!r}: nothing may follow the commit message")
            if kind == "header":
                header = message.header
                if any(m.model == header.model for m in models):
                    raise InvalidRequest(f"model {header.model!r} appears twice in one publish")
                if models:
                    models[-1].check_complete()
                    _check_group_header(models[0].header, header)
                self.check(header, models[0].header if models else None)
                models.append(self._model(header, "stream", counted))
                turn.header()
            elif not models:
                raise InvalidRequest(NO_HEADER)
            elif kind == "chunk":
                turn.chunk()
                models[-1].add(message.chunk)
            elif kind in ("written", "uploaded"):
                # A `written` keeps the header's hold: a same-host writer's pace is a memory copy.
                part = getattr(message, kind)
                model = models[-1] = self._staged(models[-1], part.upload, owner, counted, kind)
                if kind == "written":
                    model.written(part.end)
                    turn.written()
                else:
                    model.uploaded(part)
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
            names = ", ".join(repr(m.model) for m in models)
            raise InvalidRequest(
                f"model {names}: the publish stream ended without a commit message, so nothing "
                "was published (the publisher was cancelled or failed before finishing)"
            )
        return commit

    def _model(self, header: pb.PublishHeader, transport: str, counted: Callable[[Version], None]) -> IncomingModel:
        return IncomingModel(
            header,
            transport,
            shared_memory=self.shared_memory,
            header_limits=self.store.header_limits,
            announcements=self.announcements,
            counted=counted,
        )

    def _staged(
        self,
        model: IncomingModel,
        upload: str,
        owner: bytes | None,
        counted: Callable[[Version], None],
        kind: str,
    ) -> IncomingModel:
        """The staged upload `upload` that a `written` or `uploaded` message names, taken by the
        first such message; InvalidRequest when the model's bytes came otherwise."""
        if model.transport == "stream":
            if model.received:
                raise InvalidRequest(f"model {model.model!r}: a model's bytes come as chunks or one `uploaded`")
            staged = self.staged.take(upload, model.model, model.total_bytes, owner=owner)
            staged.header, staged.counted, staged.shared_memory = model.header, counted, self.shared_memory
            return staged
        if upload != model.id or model.moved:
            out_of_order = "`written` after another upload or its `uploaded`"
            raise InvalidRequest(
                f"model {model.model!r}: "
                + (out_of_order if kind == "written" else "a model's bytes come as chunks or one `uploaded`")
            )
        return model

    async def _commit(self, uploads: list, first: pb.PublishHeader) -> list[Version]:
        loop = asyncio.get_running_loop()
        committing = loop.run_in_executor(
            self._threads, lambda: self.store.publish_group(uploads, version=first.version, publish_id=first.publish_id)
        )
        try:
            return await asyncio.shield(committing)
        finally:
            # A call cancelled meanwhile leaves the commit running in its thread: it finishes with
            # the uploads before they are let go, and a retry with the same publish id finds it.
            await asyncio.wait([committing])


async def _within(
    messages: AsyncIterator[pb.PublishRequest], seconds: float | None
) -> AsyncIterator[pb.PublishRequest]:
    """The messages of a stream that takes at most `seconds` in all: a stalled publisher must
    not hold its receive buffer forever."""
    if seconds is None:
        async for message in messages:
            yield message
        return
    deadline = asyncio.get_running_loop().time() + seconds
    iterator = aiter(messages)
    while True:
        try:
            message = await asyncio.wait_for(anext(iterator), max(deadline - asyncio.get_running_loop().time(), 0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the publish stream took longer than the server's limit of {seconds:g}s and was dropped "
                "(nothing was published); raise `weightserver serve --publish-timeout` for larger models "
                "or slower links"
            ) from None
        yield message


def _check_group_header(first: pb.PublishHeader, header: pb.PublishHeader) -> None:
    if header.version and header.version != first.version:
        raise InvalidRequest(
            f"model {clipped_repr(header.model)}: a multi-model publish has one version number; this header asks for "
            f"{header.version} but the first asks for {first.version or 'the next one'} (leave later ones 0)"
        )
    if header.publish_id and header.publish_id != first.publish_id:
        raise InvalidRequest(
            f"model {header.model!r}: a multi-model publish has one publish id, the first header's; this "
            f"header gives {header.publish_id!r} (leave later ones empty)"
        )


def _declared_sha256s(models: list[IncomingModel], commit: pb.PublishCommit) -> list[str | None]:
    """Each model's sha256 as declared in its header and/or the commit message; None for a
    model whose header declares only an xxh3."""
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
