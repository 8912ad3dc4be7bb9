"""IncomingModel: the one receiver of a model's bytes in a publish, whatever the transport.

The bytes land in a buffer of the declared size (a shared-memory file when there is room, then
served from there); each stretch is hashed in the model's own thread as it lands, so no pass
over the bytes follows the transfer, and announced to cut-through watchers."""

from __future__ import annotations

import functools
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field

from weightserver.protocol import errors, page_tables
from weightserver.protocol.digests import FileDigests, IncomingDigests, tensor_digests, xxh3_hex
from weightserver.protocol.safetensors_format import parse_header
from weightserver.publish.incoming import IncomingPublish, IncomingPublishes
from weightserver.storage.store import Upload, Version
from weightserver.transports.shared_memory import PublisherMemory, SharedMemoryFiles, UploadFile
from weightserver.v1 import weights_pb2 as pb

HASH_STRETCH = 1 << 20  # bytes are handed to the hashing thread this many at a time


@functools.cache
def _tensor_hashing() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(2, thread_name_prefix="weightserver-tensor-hash")  # xxhash lets go of the GIL


@dataclass(eq=False, repr=False)  # compared and shown as an object: it holds a buffer
class IncomingModel:
    """One model's bytes on their way into a publish, over "stream", "bulk" or "shm"."""

    header: pb.PublishHeader
    transport: str = "stream"
    _: KW_ONLY
    shared_memory: SharedMemoryFiles | None
    header_limits: dict[str, int]
    announcements: IncomingPublishes
    owner: bytes | None = None  # the token that may name a staged upload
    id: str = field(default_factory=lambda: secrets.token_hex(16))
    active: float = field(default_factory=time.monotonic)  # when its bytes last moved (a staged upload expires after)
    announcement: IncomingPublish | None = None  # told to watchers with the first bytes
    file: UploadFile | None = None  # the buffer's file, removed unless committed
    buffer: memoryview | None = None
    digests: IncomingDigests | None = None
    received: int = 0  # bytes [0, received) are in (or, for a writer's, announced)
    complete: bool = False  # a bulk transfer's end: every byte is in
    moved: bool = False  # `uploaded` came: the staged upload holds every byte
    failure: BaseException | None = None  # why a bulk transfer stopped short
    committed: bool = False  # whether these bytes became a version (not so for a repeat)
    declared_tensors: dict[str, str] = field(default_factory=dict)  # a same-host writer's tensor xxh3s (`uploaded`)
    _handed: int = 0  # bytes handed to the hashing thread
    _hashing: ThreadPoolExecutor | None = None
    _hashed: Future[None] | None = None

    @property
    def model(self) -> str:
        return self.header.model

    @property
    def total_bytes(self) -> int:
        return self.header.total_bytes

    def allocate(self, *, populate: bool = False) -> None:
        """Receive into shared memory where there is room (over "shm": a memfd the publisher writes), else memory."""
        shm, file = self.transport == "shm", None
        if self.shared_memory is not None:
            file = self.shared_memory.new_upload(self.model, self.total_bytes, populate=populate, publisher_writes=shm)
        if file is None and shm:
            raise OSError("no room in the shared-memory folder")
        self.file = file
        self.buffer = file.buffer if file is not None else page_tables.anonymous(self.total_bytes)
        if not isinstance(file, PublisherMemory):  # a stream's sha256 here, else the store's after the commit
            sha256 = self.transport == "stream" and bool(self.header.sha256 or not self.header.xxh3)
            self.digests = IncomingDigests(self.buffer, sha256=sha256, header_limits=self.header_limits)

    def add(self, chunk: bytes) -> None:
        if self.transport != "stream":
            raise errors.InvalidRequest(f"model {self.model!r}: chunks after `uploaded`; send one or the other")
        if self.buffer is None:
            self.allocate()
        end = self.received + len(chunk)
        if end > self.total_bytes:
            raise errors.IntegrityError(
                f"model {self.model!r}: publisher declared {self.total_bytes} bytes but sent more"
            )
        self.buffer[self.received : end] = chunk
        self.arrived(end)

    def arrived(self, end: int) -> None:
        """Bytes [0, end) are in: hash them while the next arrive (a bulk transfer waits at its end,
        so that a malformed header stops it before its acknowledgement)."""
        self.received, self.active = end, time.monotonic()
        if self.announcement is None and self.total_bytes:
            assert self.buffer is not None
            self.announcement = self.announcements.start(self.model, self.buffer)
        if self.announcement is not None:
            self.announcement.advance(end)
        if end - self._handed >= HASH_STRETCH or end == self.total_bytes:
            if self._hashed is not None and self._hashed.done():
                self._hashed.result()  # what an earlier stretch raised stops the transfer early
            if self._hashing is None:
                self._hashing = ThreadPoolExecutor(1, thread_name_prefix=f"weightserver-{self.transport}-upload-hash")
            self._handed = end
            self._hashed = self._hashing.submit(self._hash, end)
            if end == self.total_bytes and self.transport == "bulk":
                self._hashed.result()

    def written(self, end: int) -> None:
        """A same-host writer's bytes [0, end) are written: progress only, as nothing is read
        before the seal (no cut-through: those bytes may still change)."""
        if self.transport != "shm":
            raise errors.InvalidRequest(
                f"model {self.model!r}: `written` is for a shared-memory upload; upload {self.id} is {self.transport}"
            )
        if not self.received <= end <= self.total_bytes:
            raise errors.InvalidRequest(
                f"model {self.model!r}: `written` says {end} bytes, after {self.received}, of {self.total_bytes}; "
                "it must not go back or beyond the size"
            )
        self.received, self.active = end, time.monotonic()

    def uploaded(self, message: pb.PublishUploaded) -> None:
        if message.xxh3:
            if self.header.xxh3 and self.header.xxh3.lower() != message.xxh3.lower():
                raise errors.IntegrityError(
                    f"model {self.model!r}: header declares xxh3 {errors.clipped_repr(self.header.xxh3)} but "
                    f"`uploaded` declares {errors.clipped_repr(message.xxh3)}"
                )
            self.header.xxh3 = message.xxh3
        self.declared_tensors = {name: digest.lower() for name, digest in message.tensor_xxh3.items()}
        self.received, self.moved = self.total_bytes, True

    def transferred(self, error: BaseException | None) -> None:
        self.complete, self.failure, self.active = error is None, error, time.monotonic()
        if error is not None and self.announcement is not None:
            self.announcement.fail(f"the bulk upload stopped short: {str(error) or type(error).__name__}")

    def check_complete(self) -> None:
        if self.received != self.total_bytes:
            raise errors.IntegrityError(
                f"model {self.model!r}: publisher declared {self.total_bytes} bytes but sent "
                f"{self.received}; the upload was cut short or the header is wrong"
            )

    def finish(self) -> FileDigests | None:
        """The digests once all bytes are in and hashed (None: the store checks them). Blocks."""
        if isinstance(self.file, PublisherMemory):
            return self._sealed(self.file)
        if self.transport == "bulk" and not self.complete:
            if isinstance(self.failure, errors.WeightServerError):
                raise self.failure  # bytes that are no safetensors file: the check's own error
            why = (str(self.failure) or type(self.failure).__name__) if self.failure else "it has not finished"
            raise errors.IntegrityError(
                f"model {self.model!r}: the bulk upload of {self.total_bytes} bytes did not arrive whole ({why}); "
                "publish again"
            )
        if self._hashed is not None:
            self._hashed.result()
        self.settle()
        return self._hash()

    def _sealed(self, file: PublisherMemory) -> FileDigests:
        """Seal a same-host writer's memfd. With its xxh3 and every tensor's declared, commit with those
        (checked after the commit, `storage.hashing`: a pass here cost 32-41 ms of a 256 MiB publish);
        else hash it, the tensors on another core while this one hashes the file."""
        declared = self.declared_tensors if self.header.xxh3 else {}
        self.buffer = file.seal(self.model, populate=not declared)
        header = parse_header(self.buffer, self.total_bytes, **self.header_limits)
        if declared and declared.keys() == {t.name for t in header.tensors}:
            return FileDigests(self.header.xxh3.lower(), declared, header, declared=True)
        tensors = _tensor_hashing().submit(tensor_digests, self.buffer, header)
        return FileDigests(xxh3_hex(self.buffer), tensors.result(), header)

    def as_upload(self, sha256: str | None, digests: FileDigests | None) -> Upload:
        return Upload(
            self.model,
            self.buffer if self.buffer is not None else memoryview(b""),
            sha256=sha256,
            total_bytes=self.total_bytes,
            metadata=dict(self.header.metadata),
            pin=self.header.pin,
            digests=digests,
            xxh3=self.header.xxh3 or None,
        )

    def adopt(self, record: Version) -> None:
        """In the commit, once `record` is durable and before a reader can see it: a same-host
        reader finds the version's file and header in place."""
        self.committed = True
        if self.announcement is not None:
            self.announcements.committed(self.announcement, record.model, record.version)
        if self.file is not None and self.shared_memory is not None:
            self.shared_memory.adopt(record, self.file)

    def settle(self) -> None:
        if self._hashing is not None:
            self._hashing.shutdown(wait=True, cancel_futures=True)

    def discard(self, why: str = "the upload was never committed") -> None:
        self.settle()
        if self.announcement is not None and not self.committed:
            self.announcement.fail(why)  # followers that took bytes early drop them
        if self.file is not None and self.file.path.exists():
            self.file.abort()

    def _hash(self, end: int | None = None) -> FileDigests | None:
        """Hash bytes [0, end) on, or (None) finish. A stream's bytes that are no safetensors file
        are hashed no further: the store's check says what is wrong."""
        try:
            if self.digests is not None and end is not None:
                self.digests.advance(end)
            elif self.digests is not None:
                return self.digests.finish()
        except errors.InvalidSafetensors:
            if self.transport != "stream":
                raise
            self.digests = None
        return None
