"""SharedMemoryFiles: payloads as files under a shared-memory directory (/dev/shm).

A collector on the same host (or sharing a /dev/shm volume in compose) reads the file named in
the fetch reply straight into its buffer instead of receiving a stream: a page-cache copy
instead of a socket. Each payload is written once (temp file + rename, so readers never see a
partial file) and removed when its version is evicted. The client verifies the file's xxh3
and falls back to streaming if it cannot open it or the digest differs.

Beside each version's own file lies its header (the layout is in weightserver.protocol.files): a
client that has been handed one version of a model can then read any later version it names,
digests included, without a round trip.

Every file's space is reserved before a byte is written (posix_fallocate): a store to a page
that a full tmpfs cannot back kills the process with SIGBUS. When the folder is full, a publish
is received into memory instead and a fetch is offered the next transport; the publish and the
fetch still succeed, and one warning says how to give the folder more room.

Every file the server maps is one it made and only it writes (SharedMemoryUpload: created
read-only, written through the descriptor that created it and its mapping), so no other
process can change a version it serves or shorten the file under its mapping (a mapped page
past a file's end is a SIGBUS). A same-host publisher writes into a file of its own beside
(PublisherFile), which the server reads only with pread, copying it into its own.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from weightserver.protocol import page_tables
from weightserver.protocol.files import FOLDER_MODE, header_file_name, version_file_name

log = logging.getLogger(__name__)

# In a server's folder, beside the model folders (a model name cannot start with "."): the file
# its server holds an exclusive flock on while it runs.
LOCK_FILE = ".lock"
# Beside them too: where the server receives a same-host publisher's bytes, into files of its
# own that no other process opens (mode 0700) until one becomes a version's file at its commit.
RECEIVING_FOLDER = ".receiving"


def server_shm_dir(port: int, root: Path | None = None) -> Path | None:
    """This server's own directory, <root>/weightserver-<port>-<random>-<pid> (unique even for
    several port-0 servers in one process), or None (shared memory off) when `root` (default
    /dev/shm) does not exist. Folders of servers that died uncleanly are removed first: it is memory."""
    root = Path("/dev/shm") if root is None else Path(root)
    if not root.is_dir():
        log.warning("shared-memory directory %s does not exist; same-host fetches will stream", root)
        return None
    _remove_abandoned(root)
    return root / f"weightserver-{port}-{secrets.token_hex(4)}-{os.getpid()}"


def _remove_abandoned(root: Path) -> None:
    """Remove the folders under `root` whose server is gone: those whose lock file nobody holds.

    A running server holds flock(LOCK_EX) on its folder's LOCK_FILE for its whole life, and the
    kernel drops the lock when the process dies, however it dies. Unlike a PID, a lock means the
    same thing to servers in other PID namespaces (containers) sharing this /dev/shm. A folder
    without a lock file is left alone: it is a server's of an older release (alive or not, no
    one here can tell) or one being created this instant (the lock file follows the mkdir)."""
    unlocked = []
    for folder in root.glob("weightserver-*-*"):
        try:
            fd = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if folder.is_dir() and not folder.is_symlink():
                unlocked.append(folder.name)
            continue
        except OSError:
            continue  # another user's, or not a folder: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its server is running
        try:
            log.info("removing %s, left by a server that is gone", folder)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
    if unlocked:
        log.info(
            "leaving %d folder(s) without a lock file in %s (%s): servers of an older release, maybe "
            "still running; remove them by hand once those servers are gone",
            len(unlocked),
            root,
            ", ".join(sorted(unlocked)[:5]) + (", ..." if len(unlocked) > 5 else ""),
        )


def _write_file(path: Path, data: bytes | bytearray | memoryview, mode: int) -> None:
    """Write `path` whole with `mode` (temp file + rename: a reader never sees part of it).
    OSError (ENOSPC) before anything is written when the folder has no room for it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # left by a crash, and read-only if it was a header's
    try:
        with open(tmp, "wb") as f:
            view = memoryview(data)
            _reserve(f.fileno(), view.nbytes)
            f.write(view)
        os.chmod(tmp, mode)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _reserve(fd: int, size: int) -> None:
    """Allocate `size` bytes of the file `fd` now, not page by page as they are written."""
    if size:
        os.posix_fallocate(fd, 0, size)


def _usage(directory: Path) -> str:
    """'64.0 MiB, 3.2 MiB free': the size of the file system holding `directory`."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return "size unknown"
    return f"{st.f_blocks * st.f_frsize / 2**20:.1f} MiB, {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"


class SharedMemoryFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        # Held until close() or the process's end: while it is, no other server removes the folder.
        self._lock_fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock = threading.Lock()
        self._files: dict[tuple[str, int, int, str], Path] = {}
        self._warned = False  # about a full folder, once per server

    def existing(self, key: tuple[str, int, int, str]) -> Path | None:
        """The file of payload `key` if it was written already."""
        with self._lock:
            return self._files.get(key)

    def path_for(self, key: tuple[str, int, int, str], data: bytes | bytearray | memoryview) -> Path | None:
        """The file holding `data` for payload `key` (model, version, base, dtype), written
        once; None when it cannot be written (the folder is full): offer another transport."""
        with self._lock:
            path = self._files.get(key)
            if path is not None and path.exists():
                return path
            model, version, base, dtype = key
            suffix = (f"-delta{base}" if base else "") + (f"-{dtype}" if dtype else "")
            path = self.directory / model / version_file_name(version, suffix)
            try:
                path.parent.mkdir(mode=FOLDER_MODE, exist_ok=True)
                _write_file(path, data, 0o644)
            except OSError as exc:
                self._cannot_write(f"{model!r} v{version}", len(data), exc, "this fetch uses bulk TCP or the stream")
                return None
            self._files[key] = path
            return path

    def new_upload(
        self, model: str, size: int, *, populate: bool = False, publisher_writes: bool = False
    ) -> SharedMemoryUpload | None:
        """A fresh file of `size` bytes, mapped writable, for a publish to receive into: the
        version's bytes then live in shared memory from the start. None when the folder has no
        room: the publish is received into memory instead. `populate`: map every page now (see
        SharedMemoryUpload). `publisher_writes`: a same-host publisher writes the bytes, into a
        file of its own beside (`upload.source`, the one Negotiate names), and this server
        copies them from there into the upload as it is told they are written."""
        path = self.directory / model / f"upload-{secrets.token_hex(8)}.tmp"
        source: PublisherFile | None = None
        try:
            path.parent.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            if not publisher_writes:
                return SharedMemoryUpload(path, size, populate=populate)
            source = PublisherFile(path, size)
            receiving = self.directory / RECEIVING_FOLDER
            receiving.mkdir(mode=0o700, exist_ok=True)
            upload = SharedMemoryUpload(receiving / f"{secrets.token_hex(8)}.tmp", size, populate=populate)
        except OSError as exc:
            if source is not None:
                source.remove()
            self._cannot_write(f"a publish of {model!r}", size, exc, "it is received into memory instead")
            return None
        upload.source = source
        return upload

    def adopt(self, key: tuple[str, int, int, str], upload: SharedMemoryUpload) -> None:
        """Make a committed upload's file the payload file of `key`."""
        model, version, _, _ = key
        path = self.directory / model / version_file_name(version)
        upload.keep_as(path)
        with self._lock:
            self._files[key] = path

    def write_header(self, model: str, version: int, header: Callable[[], bytes | None]) -> None:
        """(Re)write the header file of `version` if its own file is here. `header()` is called
        under this object's lock, so of two concurrent writers (a lazy file, a pin) the later
        one writes the later state; it returns None when the version is gone."""
        with self._lock:
            if (model, version, 0, "") not in self._files:
                return
            content = header()
            if content is None:
                return
            try:
                _write_file(self.directory / model / header_file_name(version), content, 0o444)
            except OSError as exc:
                # Without its header a version is not read directly: clients ask the server.
                self._cannot_write(f"the header of {model!r} v{version}", len(content), exc, "clients ask the server")

    def keys(self) -> list[tuple[str, int, int, str]]:
        with self._lock:
            return list(self._files)

    def forget(self, model: str, version: int) -> None:
        """Remove the files of every payload derived from (or against) `version`."""
        with self._lock:
            for key in [k for k in self._files if k[0] == model and version in (k[1], k[2])]:
                path = self._files.pop(key)
                if key[1:] == (version, 0, ""):  # a reader that finds the header finds the file
                    path.with_name(header_file_name(version)).unlink(missing_ok=True)
                path.unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._lock_fd >= 0:  # released only once the folder is gone
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _cannot_write(self, what: str, size: int, exc: OSError, instead: str) -> None:
        """Log that `what` found no room (a warning the first time, with what to do about it)."""
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.warning("cannot write %s (%d bytes) in %s: %s; %s", what, size, self.directory, exc, instead)
            return
        if self._warned:
            log.debug("shared memory full: no room for %s (%d bytes); %s", what, size, instead)
            return
        self._warned = True
        log.warning(
            "shared-memory folder %s is full (%s): no room for %s (%d bytes), so %s. Same-host "
            "fetches fall back to bulk TCP or the stream until there is room. It needs about "
            "(--keep + 3) x the model's size (a publish in flight and the next one set up ahead, each "
            "held twice while a same-host publisher writes it: its file and this server's copy), plus "
            "derived payloads (deltas, casts): give it more "
            "(`shm_size` in compose, `docker run --shm-size`), point --shm-dir at a larger tmpfs, or "
            "turn it off with --no-shm. This warning is logged once.",
            self.directory,
            _usage(self.directory),
            what,
            size,
            instead,
        )


class SharedMemoryUpload:
    """A publish's receive buffer backed by a file in the shared-memory directory that only this
    process writes: it is created read-only for everyone (this process writes it through the
    descriptor that created it, then its mapping), so no other process holds a descriptor that
    can write, grow or shrink it, and a version served from its mapping cannot change or end
    under the server (a mapped page past a file's end is a SIGBUS). `source`: the file a
    same-host publisher writes the bytes into, read from by this server, never mapped."""

    def __init__(self, path: Path, size: int, *, populate: bool = False) -> None:
        """OSError (ENOSPC) when the folder has no room for `size` bytes; no file is left.
        `populate`: fill this process's page table for the mapping in the background
        (`page_tables`), rather than a page fault at a time while the bytes
        arrive or are copied in: for an upload set up before its bytes come."""
        self.path = path
        self.source: PublisherFile | None = None
        self._kept = False  # it became a version's file
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
            try:
                # Allocated now: pages of a sparse file would be allocated as the chunks arrive,
                # and one that a full tmpfs cannot back is a SIGBUS, not an error.
                _reserve(fd, size)
                # A zero-length file cannot be mapped; an empty upload gets a plain buffer.
                mapping = mmap.mmap(fd, size) if size else None
            finally:
                os.close(fd)
            if mapping is not None and populate:
                threading.Thread(target=page_tables.populate, args=(mapping,), name="weightserver-populate").start()
            self.buffer: memoryview = memoryview(mapping) if mapping is not None else memoryview(bytearray())
        except OSError:
            path.unlink(missing_ok=True)
            raise

    def keep_as(self, path: Path) -> None:
        """Make the file `path` (a version's file): the publisher's file goes."""
        self.remove_source()
        self.path.replace(path)
        self._kept = True

    def remove_source(self) -> None:
        """Let the publisher's file go, once its bytes are copied or no longer wanted."""
        if self.source is not None:
            self.source.remove()

    def abort(self) -> None:
        """Remove the files of an upload that did not commit (nothing once it did)."""
        self.remove_source()
        if not self._kept:
            self.path.unlink(missing_ok=True)


class PublisherFile:
    """The file a same-host publisher writes a model into, named in Negotiate's answer.

    This server never maps it: the publisher (or any process of its user) may write, shorten
    or grow it at any time, and a mapped page past a file's end kills the process with
    SIGBUS. The server reads it with pread (`read_into`) into a buffer of its own: a file cut
    short reads short, an error, never a signal, and what is verified is the copy it serves.
    """

    def __init__(self, path: Path, size: int) -> None:
        """OSError (ENOSPC) when the folder has no room for `size` bytes; no file is left."""
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self._lock = threading.Lock()
        try:
            os.fchmod(self._fd, 0o644)  # whatever the umask: the publisher writes it
            # Allocated now, as a receive buffer is: the publisher's own stores into a page that
            # a full tmpfs cannot back would be its SIGBUS.
            _reserve(self._fd, size)
        except OSError:
            self.remove()
            raise

    def read_into(self, buffer: memoryview, start: int, stop: int) -> int:
        """Copy the file's bytes [start, stop) into `buffer[start:stop]`; how many it held
        (fewer once the file ends before `stop`)."""
        view, done = buffer[start:stop], 0
        try:
            while done < view.nbytes:
                n = os.preadv(self._fd, [view[done:]], start + done)
                if n == 0:
                    break
                done += n
        finally:
            view.release()
        return done

    def remove(self) -> None:
        """Close the file and remove it (a publisher still holding it keeps its own copy)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self.path.unlink(missing_ok=True)
