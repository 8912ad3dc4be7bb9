"""StagedUploads: uploads Negotiate set up (bulk, shm) under a random id only their caller's token
may name, until a Publish names them; a claim that does not match leaves it to its owner."""

from __future__ import annotations

import functools
import logging
import threading
import time

from weightserver.protocol.errors import InvalidRequest, PermissionDenied, TooManyUploads, UploadNotFound, clipped_repr
from weightserver.publish.incoming import IncomingPublishes
from weightserver.publish.receiver import IncomingModel
from weightserver.transports.shared_memory import SharedMemoryFiles
from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)

UPLOAD_TTL_SECONDS = 60.0  # after Negotiate, or after its bytes last moved
SWEEP_SECONDS = 1.0
MAX_STAGED_UPLOADS = 64  # set up and not yet named: each may hold a model's size of memory


class StagedUploads:
    def __init__(
        self, header_limits: dict[str, int], incoming: IncomingPublishes, shared_memory: SharedMemoryFiles | None
    ) -> None:
        self._receiver = functools.partial(
            IncomingModel, shared_memory=shared_memory, header_limits=header_limits, announcements=incoming
        )
        self._max = MAX_STAGED_UPLOADS
        self._lock = threading.Lock()
        self._uploads: dict[str, IncomingModel] = {}
        self._allocating = 0  # uploads being set up: they count towards `_max` already
        self._closed = threading.Event()
        threading.Thread(target=self._sweep, name="weightserver-upload-sweeper", daemon=True).start()

    def transports(self) -> list[str]:
        """The transport of each upload set up and not yet named (for operators and tests)."""
        with self._lock:
            return [upload.transport for upload in self._uploads.values()]

    def create(self, model: str, size: int, transport: str, *, owner: bytes | None = None) -> IncomingModel:
        """An upload over `transport` ("bulk" or "shm") that only `owner` may name (see `IncomingModel.allocate`)."""
        with self._lock:  # its place is taken now: calls allocating at once must not all pass
            if (held := len(self._uploads) + self._allocating) >= self._max:
                raise TooManyUploads(
                    f"{held} publishes over bulk or shared memory are set up and not yet committed, "
                    f"the most this server holds; finish or cancel those (they expire "
                    f"{UPLOAD_TTL_SECONDS:.0f} s after Negotiate) or publish over the stream"
                )
            self._allocating += 1
        try:
            upload = self._receiver(pb.PublishHeader(model=model, total_bytes=size), transport, owner=owner)
            upload.allocate(populate=True)
        except BaseException:
            with self._lock:
                self._allocating -= 1
            raise
        with self._lock:
            self._allocating -= 1
            if not (closed := self._closed.is_set()):  # (else `close` has let every upload go)
                self._uploads[upload.id] = upload
        if closed:
            upload.discard()
            raise OSError("the server is stopping")  # (the transport declines: the caller streams)
        return upload

    def take(self, upload_id: str, model: str, total_bytes: int, *, owner: bytes | None = None) -> IncomingModel:
        with self._lock:
            upload = self._uploads.get(upload_id)
            if upload is not None and (upload.owner, upload.model, upload.total_bytes) == (owner, model, total_bytes):
                return self._uploads.pop(upload_id)
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
        while not self._closed.wait(SWEEP_SECONDS):
            since = time.monotonic() - UPLOAD_TTL_SECONDS
            with self._lock:
                expired = [self._uploads.pop(u.id) for u in list(self._uploads.values()) if u.active < since]
            for gone in expired:
                log.info(
                    "upload %s of %r (%s) expired unused; its bytes are dropped", gone.id, gone.model, gone.transport
                )
                gone.discard()
