"""StagedUploads: a publish's bytes moved outside the Publish stream, until a Publish names them.

Negotiate (DIRECTION_PUBLISH) sets up one model's upload: a buffer of the announced size (a
file in the shared-memory folder when there is one, so a committed version is served from
there without another copy) and an id. The bytes then arrive over bulk TCP (the endpoint hashes
each stretch as it lands) or are written by a same-host publisher into a file of its own
beside, which the server copies into its buffer with pread (in up to 4 threads) as the
publisher says how far it has written, hashing each block of its copy as it lands (the rest
once the publisher says it is done). So what the server verifies is the copy it serves: the
publisher's file may change, shrink or vanish before or after, and that can only fail the
publish (a short read is DATA_LOSS), never change a version or crash the server. A Publish
stream names the id after the model's header; the upload is then the stream's, and goes
with it. Only the caller that set an upload up may name it (with tokens: the same token;
without, anyone who knows the id), and a claim that does not match (another token, another
model or size) is refused and leaves the upload to its owner. Uploads nobody names expire: a
sweeper thread, running while any upload is staged, drops them and their files.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from weightserver.protocol.digests import BLOCK_BYTES, FileDigests, IncomingDigests
from weightserver.protocol.errors import (
    IntegrityError,
    InvalidRequest,
    PermissionDenied,
    TooManyUploads,
    UploadNotFound,
    WeightServerError,
    clipped_repr,
)
from weightserver.publish.incoming import IncomingPublish, IncomingPublishes
from weightserver.transports.shared_memory import PublisherFile, SharedMemoryUpload

log = logging.getLogger(__name__)

UPLOAD_TTL_SECONDS = 60.0
SWEEP_SECONDS = 1.0
MAX_STAGED_UPLOADS = 64  # set up and not yet named: each may hold a model's size of memory
# Threads that copy shared-memory writers' blocks in, for all uploads: at most this many, and
# one CPU fewer than the machine has (one is the writer's). None: the upload's thread copies.
COPY_THREADS = 4
_copy_threads: ThreadPoolExecutor | None = None
_copy_threads_lock = threading.Lock()


def _copying() -> ThreadPoolExecutor | None:
    """The threads that copy a shared-memory writer's blocks into uploads (pread lets go of
    the GIL), started at the first such upload; None on a machine of two CPUs or fewer,
    where they only add to what those do."""
    global _copy_threads
    workers = min(COPY_THREADS, (os.cpu_count() or 1) - 1)
    if workers < 2:
        return None
    with _copy_threads_lock:
        if _copy_threads is None:
            _copy_threads = ThreadPoolExecutor(workers, thread_name_prefix="weightserver-shm-upload-copy")
        return _copy_threads


@dataclass(eq=False)
class StagedUpload:
    """One model's bytes, arriving or arrived, outside a Publish stream."""

    id: str
    model: str
    total_bytes: int
    transport: str  # "bulk" or "shm": who writes the buffer
    buffer: memoryview = field(repr=False)
    file: SharedMemoryUpload | None = field(repr=False)  # the buffer's file, in shared memory
    digests: IncomingDigests = field(repr=False)
    expires: float
    received: bool = False  # every byte is in the buffer (bulk); a shm writer says so by naming it
    failure: BaseException | None = None  # why the transfer stopped short
    # Announced to watchers with the first bytes (cut-through), by `arrivals`.
    arrivals: IncomingPublishes | None = field(default=None, repr=False)
    arriving: IncomingPublish | None = field(default=None, repr=False)
    # Shared memory: how far the writer said it has written, and how far this server has copied.
    written_end: int = 0
    copied: int = 0
    owner: bytes | None = field(default=None, repr=False)  # the token that may name it (None: anyone)
    # The thread that hashes the bytes as they arrive or are written, and its latest stretch.
    _hashing: ThreadPoolExecutor | None = field(default=None, repr=False)
    _hashed: Future | None = field(default=None, repr=False)

    def arrived(self, end: int) -> None:
        """Bytes [0, end) are in (bulk): hash the new ones in this upload's thread while the
        next ones arrive; once all are in, wait for it (a malformed header, found there,
        stops the transfer before its acknowledgement). A transfer that moves keeps the
        upload from expiring."""
        self._hash_to(end)
        if end == self.total_bytes:
            self._hashing_done()
        self._landed(end)

    def written(self, end: int) -> None:
        """A shared-memory writer's word that bytes [0, end) are written for good: copy them
        into this upload's buffer and hash them there, in a thread of this upload's own while
        it writes the rest (the event loop only hands them over), announcing them to watchers
        as they land. InvalidRequest for an upload that is not written in place, or an `end`
        that goes back or beyond the size."""
        if self.transport != "shm":
            raise InvalidRequest(
                f"model {self.model!r}: `written` is for a shared-memory upload; upload {self.id} is {self.transport}"
            )
        if not self.written_end <= end <= self.total_bytes:
            raise InvalidRequest(
                f"model {self.model!r}: `written` says {end} bytes, after {self.written_end}, of {self.total_bytes}; "
                "it must not go back or beyond the size"
            )
        self.written_end = end
        self._landed(end)  # announced now; the copying thread tells how far the bytes landed
        self._hash_to(end)

    def _landed(self, end: int) -> None:
        """Bytes [0, end) are in (or, for a writer's, on their way): the upload does not expire
        while they move, and watchers hear of them (announced with the first)."""
        self.expires = time.monotonic() + UPLOAD_TTL_SECONDS
        if self.arriving is None and self.arrivals is not None:
            self.arriving = self.arrivals.start(self.model, self.buffer)
        if self.arriving is not None and self._source is None:
            self.arriving.advance(end)

    @property
    def _source(self) -> PublisherFile | None:
        """The file a same-host publisher writes, to copy the bytes from (None: they land here)."""
        return self.file.source if self.file is not None else None

    def _hash_to(self, end: int) -> None:
        """Hash bytes up to `end` (a writer's: copy them in first) in this upload's own thread,
        after what it does now (pread and xxh3 let go of the GIL: receiving goes on meanwhile);
        raise what an earlier stretch raised there (a malformed header, a file cut short), so
        that a transfer can stop early."""
        if self._hashed is not None and self._hashed.done():
            self._hashed.result()
        if self._hashing is None:
            self._hashing = ThreadPoolExecutor(1, thread_name_prefix=f"weightserver-{self.transport}-upload-hash")
        self._hashed = self._hashing.submit(self._take if self._source is not None else self.digests.advance, end)

    def _take(self, end: int) -> None:
        """Copy the writer's bytes up to `end` into the buffer, a block per copying thread
        (one copy runs at about half the speed a writer writes), and hash each block in
        order once it is in; then announce them as landed (a stretch at a time, as the
        writer announced them). IntegrityError when the file ends first: it was cut short
        (read with pread, a short file is an error, not a SIGBUS)."""
        source = self._source
        assert source is not None
        blocks = [(start, min(end, start + BLOCK_BYTES)) for start in range(self.copied, end, BLOCK_BYTES)]
        threads = _copying()
        if threads is None:
            for start, stop in blocks:
                self._copied(start, stop, source.read_into(self.buffer, start, stop))
        else:
            copies = [threads.submit(source.read_into, self.buffer, start, stop) for start, stop in blocks]
            try:
                for (start, stop), copy in zip(blocks, copies, strict=True):
                    self._copied(start, stop, copy.result())
            finally:
                for copy in copies:  # none is left reading the file or writing the buffer
                    copy.cancel()
                wait(copies)
        if self.arriving is not None:
            self.arriving.advance(end)

    def _copied(self, start: int, stop: int, got: int) -> None:
        """`got` bytes of the writer's block [start, stop) are copied in: hash them, or
        IntegrityError when that is fewer (the file was cut short)."""
        if got < stop - start:
            raise IntegrityError(
                f"model {self.model!r}: the shared-memory upload file holds {start + got} bytes, not the "
                f"{self.total_bytes} declared (it was cut short after Negotiate); publish again"
            )
        self.copied = stop
        self.digests.advance(stop)

    def _hashing_done(self) -> None:
        """Wait until every stretch handed over is hashed; raise what the hashing raised."""
        if self._hashed is not None:
            self._hashed.result()

    def settle(self) -> None:
        """Wait for the stretch being hashed, drop those not started, and end the thread."""
        if self._hashing is not None:
            self._hashing.shutdown(wait=True, cancel_futures=True)

    def transferred(self, error: BaseException | None) -> None:
        """The bulk endpoint's word on the transfer: all bytes in, or why not."""
        if error is None:
            self.received = True
        else:
            self.failure = error
            if self.arriving is not None:
                self.arriving.fail(f"the bulk upload stopped short: {str(error) or type(error).__name__}")
        self.expires = time.monotonic() + UPLOAD_TTL_SECONDS

    def finish(self) -> FileDigests:
        """The digests of the bytes, once they are all in (hashing what a shared-memory writer
        put in the file now; a bulk upload was hashed as it arrived). Blocks: call it off the
        event loop. IntegrityError when the transfer fell short."""
        if self.transport == "shm":
            try:
                self._hash_to(self.total_bytes)  # the writer may have announced most of it already
                self._hashing_done()
            finally:
                if self.file is not None:
                    self.file.remove_source()  # every byte is copied, or none will be
        elif not self.received:
            if isinstance(self.failure, WeightServerError):
                raise self.failure  # bytes that are no safetensors file: the check's own error
            why = (str(self.failure) or type(self.failure).__name__) if self.failure else "it has not finished"
            raise IntegrityError(
                f"model {self.model!r}: the bulk upload of {self.total_bytes} bytes did not arrive whole ({why}); "
                "publish again"
            )
        self._hashing_done()
        self.settle()
        return self.digests.finish()

    def discard(self) -> None:
        """Let the bytes go (a file is removed; a commit has moved it away already)."""
        self.settle()
        if self.arriving is not None:
            self.arriving.fail("the upload was never committed")
        if self.file is not None and self.file.path.exists():
            self.file.abort()


class StagedUploads:
    """The uploads set up and not yet named by a Publish stream, by id."""

    def __init__(
        self, header_limits: dict, *, max_uploads: int = MAX_STAGED_UPLOADS, incoming: IncomingPublishes | None = None
    ) -> None:
        self._header_limits = header_limits
        self._incoming = incoming
        self._max = max_uploads
        self._lock = threading.Lock()
        self._uploads: dict[str, StagedUpload] = {}
        self._sweeper: threading.Thread | None = None
        self._closed = threading.Event()

    def create(
        self,
        model: str,
        total_bytes: int,
        transport: str,
        new_file: Callable[[], SharedMemoryUpload | None],
        *,
        owner: bytes | None = None,
    ) -> StagedUpload:
        """A new upload of `total_bytes` for `model`, in the file `new_file()` makes (None:
        in anonymous memory, which is committed page by page as bytes arrive), that only
        `owner` (the sha256 of the caller's token; None: anyone) may name."""
        self._expire()
        with self._lock:
            if len(self._uploads) >= self._max:
                raise TooManyUploads(
                    f"{len(self._uploads)} publishes over bulk or shared memory are set up and not yet committed, "
                    f"the most this server holds; finish or cancel those (they expire {UPLOAD_TTL_SECONDS:.0f} s "
                    "after Negotiate) or publish over the stream"
                )
        file = new_file()
        if file is None and transport == "shm":
            raise OSError("no room in the shared-memory folder")
        if file is not None:
            buffer = file.buffer
        else:
            buffer = memoryview(mmap.mmap(-1, total_bytes) if total_bytes else bytearray())
        upload = StagedUpload(
            id=secrets.token_hex(16),
            model=model,
            total_bytes=total_bytes,
            transport=transport,
            buffer=buffer,
            file=file,
            digests=IncomingDigests(buffer, header_limits=self._header_limits),
            expires=time.monotonic() + UPLOAD_TTL_SECONDS,
            arrivals=self._incoming,
            owner=owner,
        )
        with self._lock:
            self._uploads[upload.id] = upload
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(target=self._sweep, name="weightserver-upload-sweeper", daemon=True)
                self._sweeper.start()
        return upload

    def take(self, upload_id: str, model: str, total_bytes: int, *, owner: bytes | None = None) -> StagedUpload:
        """The upload `upload_id`, now the caller's: `owner` (the sha256 of its token, None
        without tokens) must be the one that set it up (PermissionDenied), and it must be for
        `model` and `total_bytes` (InvalidRequest). A refused claim leaves the upload staged
        for its owner."""
        self._expire()
        with self._lock:
            upload = self._uploads.get(upload_id)
            claimed = upload is not None and upload.owner == owner
            if claimed and (upload.model, upload.total_bytes) == (model, total_bytes):
                del self._uploads[upload_id]
                return upload
        if upload is None:
            raise UploadNotFound(
                f"model {model!r}: upload {clipped_repr(upload_id)} is unknown, used already or expired (uploads "
                f"expire {UPLOAD_TTL_SECONDS:.0f} s after Negotiate, and a server restart forgets them); publish again"
            )
        if upload.owner != owner:
            raise PermissionDenied(
                f"model {model!r}: upload {clipped_repr(upload_id)} was set up by another token's Negotiate; name "
                "only an upload your own Negotiate set up (it is left to its owner)"
            )
        raise InvalidRequest(
            f"model {model!r}: upload {upload_id} was set up for {upload.model!r} with {upload.total_bytes} "
            f"bytes, but the header says {total_bytes} bytes of {model!r}; send the header the upload was set up "
            "with (the upload is left as it was)"
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._uploads)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            uploads, self._uploads = list(self._uploads.values()), {}
        for upload in uploads:
            upload.discard()

    def _sweep(self) -> None:
        """Expire uploads until none is left (the next one starts a new sweeper) or close()."""
        while not self._closed.wait(SWEEP_SECONDS):
            self._expire()
            with self._lock:
                if not self._uploads:
                    self._sweeper = None
                    return

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [u for u in self._uploads.values() if u.expires < now]
            for upload in expired:
                del self._uploads[upload.id]
        for upload in expired:
            log.info(
                "upload %s of %r (%s) expired unused; its bytes are dropped", upload.id, upload.model, upload.transport
            )
            upload.discard()
