"""Shared memory: payloads as files under /dev/shm for same-host collectors, with a header file
beside each version's. Space is reserved before a byte is written (a store to a page a full tmpfs
cannot back is a SIGBUS). The server maps only files no other process can change: its own, and a
same-host publisher's memfd once sealed (`PublisherMemory`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from weightserver.protocol import page_tables
from weightserver.protocol.errors import IntegrityError, InvalidRequest, WeightServerError
from weightserver.protocol.files import FOLDER_MODE, header_file_name, version_file_name
from weightserver.protocol.version_info import version_message
from weightserver.v1 import weights_pb2 as pb

if TYPE_CHECKING:
    from weightserver.publish.incoming import IncomingPublish
    from weightserver.publish.receiver import IncomingModel
    from weightserver.publish.staged_uploads import StagedUploads
    from weightserver.storage.payloads import Payload, PayloadKey
    from weightserver.storage.store import Version, VersionStore

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"  # flocked by its server for life (a model name cannot start with ".")
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def server_shm_dir(port: int, root: Path | str = "auto") -> Path | None:
    """This server's own directory under `root` ("auto": /dev/shm); None: shared memory off. Removes
    the folders there whose lock file nobody holds (a flock, unlike a PID, holds across namespaces)."""
    root = Path("/dev/shm" if root == "auto" else root)
    if not root.is_dir():
        log.warning("shared-memory directory %s does not exist; same-host fetches will stream", root)
        return None
    unlocked = []
    for folder in root.glob("weightserver-*-*"):
        try:
            fd = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            starting = (folder / (LOCK_FILE + ".tmp")).exists()  # a server locking it now
            if folder.is_dir() and not folder.is_symlink() and not starting:
                unlocked.append(folder.name)
            continue
        except OSError:
            continue  # another user's, or not a folder: not ours to judge
        try:
            with contextlib.suppress(OSError):  # locked: its server is running
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                log.info("removing %s, left by a server that is gone", folder)
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
    if unlocked:
        names = ", ".join(sorted(unlocked)[:5]) + (", ..." if len(unlocked) > 5 else "")
        log.info("leaving %d folder(s) without a lock file in %s (%s): of an older release", len(unlocked), root, names)
    return root / f"weightserver-{port}-{secrets.token_hex(4)}-{os.getpid()}"


def _write_file(path: Path, parts: tuple[memoryview, ...], mode: int) -> None:
    """Write `path` whole from its consecutive `parts` with `mode` (temp file + rename); OSError: no room."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # left by a crash, and read-only if it was a header's
    try:
        with open(tmp, "wb") as f:
            if size := sum(p.nbytes for p in parts):
                os.posix_fallocate(f.fileno(), 0, size)
            f.writelines(parts)
        os.chmod(tmp, mode)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


class SharedMemoryFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        # Named only once locked: a server starting beside this one removes a folder whose lock it can take.
        locking = directory / (LOCK_FILE + ".tmp")
        self._lock_fd = os.open(locking, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locking.replace(directory / LOCK_FILE)
        self._lock = threading.Lock()
        self._files: dict[PayloadKey, Path] = {}
        self._memory: dict[PayloadKey, PublisherMemory] = {}  # files that are memfds
        self._warned = False  # about a full folder, once per server
        self._closed = False

    def path_for(self, key: PayloadKey, data: tuple[memoryview, ...] | None) -> Path | None:
        """The file of payload `key`, written once from `data`; None: no room, or (`data` None) not written yet."""
        with self._lock:
            path = self._files.get(key)
            if data is None or (path is not None and path.exists()):
                return path
            model, version, base, dtype, forms, selection = key
            suffix = (f"-select{selection[:16]}" if selection else "") + (f"-delta{base}" if base else "")
            suffix += (f"-{dtype}" if dtype else "") + (f"-elements-{forms.replace('+', '-')}" if forms else "")
            path = self.directory / model / version_file_name(version, suffix)
            try:
                path.parent.mkdir(mode=FOLDER_MODE, exist_ok=True)
                _write_file(path, data, 0o644)
            except OSError as exc:
                size = sum(p.nbytes for p in data)
                self._cannot_write(f"{model!r} v{version}", size, exc, "this fetch uses bulk TCP or the stream")
                return None
            self._files[key] = path
            return path

    def new_upload(
        self, model: str, size: int, *, populate: bool = False, publisher_writes: bool = False
    ) -> UploadFile | None:
        """A file for a publish to receive into (None: no room, or the server is stopping); `publisher_writes`:
        a memfd the publisher writes."""
        if self._closed:
            return None
        try:
            path = self.directory / model / f"upload-{secrets.token_hex(8)}.tmp"
            path.parent.mkdir(mode=FOLDER_MODE, exist_ok=True)  # (not the server's folder: gone once it stops)
            return PublisherMemory(path, model, size) if publisher_writes else UploadFile(path, size, populate=populate)
        except OSError as exc:
            if not self._closed:  # (else the folder went as the server stops: nothing to say)
                self._cannot_write(f"a publish of {model!r}", size, exc, "it is received into memory instead")
            return None

    def adopt(self, record: Version, upload: UploadFile) -> None:
        """`upload` becomes `record`'s file, its header written beside it."""
        key = (record.model, record.version, 0, "", "", "")
        upload.keep_as(self.directory / record.model / version_file_name(record.version))
        with self._lock:
            self._files[key] = upload.path
            if isinstance(upload, PublisherMemory):
                self._memory[key] = upload
        message = version_message(record).SerializeToString()
        self.write_header(record.model, record.version, lambda: message)

    def write_header(self, model: str, version: int, header: Callable[[], bytes | None]) -> None:
        """(Re)write `version`'s header file if its file is here; `header()` (None: gone) runs under
        the lock, so of two writers the later writes the later state."""
        with self._lock:
            if (model, version, 0, "", "", "") not in self._files or (content := header()) is None:
                return
            try:
                _write_file(self.directory / model / header_file_name(version), (memoryview(content),), 0o444)
            except OSError as exc:
                self._cannot_write(f"the header of {model!r} v{version}", len(content), exc, "clients ask the server")

    def keys(self) -> list[PayloadKey]:
        with self._lock:
            return list(self._files)

    def forget(self, model: str, version: int) -> None:
        with self._lock:
            for key in [k for k in self._files if k[0] == model and version in (k[1], k[2])]:
                path = self._files.pop(key)
                if key[1:] == (version, 0, "", "", ""):  # a reader that finds the header finds the file
                    path.with_name(header_file_name(version)).unlink(missing_ok=True)
                path.unlink(missing_ok=True)
                if key in self._memory:  # the version's mapping stays valid; readers' too
                    self._memory.pop(key).close()

    def close(self) -> None:
        self._closed = True
        shutil.rmtree(self.directory, ignore_errors=True)
        with self._lock:
            for memory in self._memory.values():
                memory.close()
            self._memory.clear()
        if self._lock_fd >= 0:  # released only once the folder is gone
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _cannot_write(self, what: str, size: int, exc: OSError, instead: str) -> None:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.warning("cannot write %s (%d bytes) in %s: %s; %s", what, size, self.directory, exc, instead)
            return
        if self._warned:
            log.debug("shared memory full: no room for %s (%d bytes); %s", what, size, instead)
            return
        self._warned, usage = True, "size unknown"
        with contextlib.suppress(OSError):
            st = os.statvfs(self.directory)
            usage = f"{st.f_blocks * st.f_frsize / 2**20:.1f} MiB, {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
        log.warning(
            "shared-memory folder %s is full (%s): no room for %s (%d bytes), so %s. It "
            "needs about (--keep + 3) x the model's size plus deltas and casts: give it more (`shm_size` in "
            "compose, `docker run --shm-size`), point --shm-dir at a larger tmpfs, or turn it off with --no-shm. "
            "This warning is logged once.",
            *(self.directory, usage, what, size, instead),
        )


class UploadFile:
    """A publish's receive buffer at `path`, a file created read-only and written through its creating
    descriptor's mapping (no other process can change or cut it under the server): `keep_as` makes it
    a version's file for same-host readers; else `abort` removes it."""

    buffer = memoryview(bytearray())  # its bytes, mapped (none yet, or none at all)
    _kept = False  # it became a version's file

    def __init__(self, path: Path, size: int, *, populate: bool = False) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
                    self.buffer = memoryview(mapping := mmap.mmap(fd, size))
            finally:
                os.close(fd)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        if size and populate:  # an upload set up before its bytes come
            threading.Thread(target=page_tables.populate, args=(mapping,), name="weightserver-populate").start()

    def keep_as(self, path: Path) -> None:
        self.path, self._kept = self.path.replace(path), True

    def abort(self) -> None:
        if not self._kept:
            self.close()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class PublisherMemory(UploadFile):
    """A same-host publisher's upload: a memfd of the server's that the publisher opens (as the server's
    user, or root) through `path`, a link of its own name (fd numbers are reused) to /proc/<pid>/fd/<n>,
    and writes. The server reads none of it until `seal`: then nobody can write, grow or shrink it, so
    the bytes hashed are the bytes served and one cut short is DATA_LOSS, not a SIGBUS. A seal is a
    syscall where copying a 256 MiB publish into a file of the server's cost 70 ms."""

    def __init__(self, path: Path, model: str, size: int) -> None:
        self.size = size
        self._fd = os.memfd_create(f"weightserver-{model}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(self._fd, 0o600)
            page_tables.reserve(self._fd, size)  # now, or the publisher's stores may be its SIGBUS
            os.symlink(f"/proc/{os.getpid()}/fd/{self._fd}", path)
        except OSError:
            os.close(self._fd)
            raise
        self.path = path
        self._lock = threading.Lock()

    def seal(self, model: str, *, populate: bool = True) -> memoryview:
        """Seal it and map it read-only (`populate`: every page now, for a hash that reads them all); InvalidRequest
        while the publisher maps it writable (or sealed it, not whole), IntegrityError if not the declared size."""
        # EBUSY may also be a page still referenced past the kernel's own ~150 ms wait: up to 0.75 s more
        for wait in (0.05, 0.1, 0.2, 0.4, None):
            try:
                fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
                break
            except OSError as exc:
                if exc.errno == errno.EPERM:  # F_SEAL_SEAL is on: the publisher sealed it; enough if it sealed all
                    if SEALS & ~fcntl.F_SEAL_SEAL & ~fcntl.fcntl(self._fd, fcntl.F_GET_SEALS):
                        raise InvalidRequest(
                            f"model {model!r}: the publisher sealed its shared-memory upload (F_SEAL_SEAL) but not "
                            "against writes, growth and shrinking, so the server cannot make it read-only; add no "
                            "seals to the upload (the server seals it at `uploaded`) and publish again"
                        ) from None
                    break
                if exc.errno != errno.EBUSY:
                    raise
                if wait is None:
                    raise InvalidRequest(
                        f"model {model!r}: the publisher still maps its shared-memory upload for writing; "
                        "unmap it (close the mapping) before `uploaded`, so that nothing can change the "
                        "bytes once committed"
                    ) from None
                time.sleep(wait)
        size = os.fstat(self._fd).st_size
        if size != self.size:
            raise IntegrityError(
                f"model {model!r}: the shared-memory upload holds {size} bytes, not the {self.size} declared "
                "(it was cut short after Negotiate); publish again"
            )
        if size:  # page tables filled in one go: faulting them in as the hash reads cost as much again
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self.buffer = memoryview(mmap.mmap(self._fd, size, flags=flags, prot=mmap.PROT_READ))
        return self.buffer

    def close(self) -> None:
        """Let go of the memfd (a mapping of it stays valid)."""
        self.path.unlink(missing_ok=True)  # first: nobody resolves the number once it can be reused
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class SharedMemoryTransport:
    """Fetches as files named in the reply (written on first demand); uploads a same-host publisher
    writes into a memfd of the server's."""

    name, kind = "shm", pb.TRANSPORT_SHARED_MEMORY

    def __init__(self, files: SharedMemoryFiles, uploads: StagedUploads, store: VersionStore) -> None:
        self.files, self.uploads, self.store = files, uploads, store

    async def offer(self, record: Version, payload: Payload, description: pb.Payload) -> bool:
        key = payload.key(record.model, record.version)
        path = self.files.path_for(key, None)  # no thread when it is written already
        if path is None:
            path = await asyncio.to_thread(self.files.path_for, key, payload.parts)
            if path is None:
                return False  # the folder is full
            if key[2:] == (0, "", "", ""):
                await asyncio.to_thread(self.write_header, record.model, record.version)
        description.shared_memory.path = str(path)
        return True

    def offer_incoming(self, incoming: IncomingPublish, description: pb.Payload) -> bool:
        return False  # a same-host reader gets the committed version's file as fast

    def stage(self, header: pb.PublishHeader, owner: bytes | None, description: pb.Payload) -> IncomingModel | None:
        try:
            upload = self.uploads.create(header.model, header.total_bytes, "shm", owner=owner)
        except OSError:
            return None
        assert isinstance(upload.file, PublisherMemory)
        description.shared_memory.path = str(upload.file.path)
        return upload

    def write_header(self, model: str, version: int) -> None:
        def current() -> bytes | None:
            try:
                return version_message(self.store.get(model, version)).SerializeToString()
            except WeightServerError:
                return None  # evicted or deleted meanwhile: its files go with it

        self.files.write_header(model, version, current)
