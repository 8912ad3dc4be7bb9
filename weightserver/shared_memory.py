"""SharedMemoryFiles: payloads as files under a shared-memory directory (/dev/shm).

A collector on the same host (or sharing a /dev/shm volume in compose) reads the file named in
the fetch reply straight into its buffer instead of receiving a stream: a page-cache copy
instead of a socket. Each payload is written once (temp file + rename, so readers never see a
partial file) and removed when its version is evicted. The client verifies the file's xxh3
and falls back to streaming if it cannot open it or the digest differs.

Beside each version's own file lies its header (the layout is in weightserver.shm_layout): a
client that has been handed one version of a model can then read any later version it names,
digests included, without a round trip.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from weightserver.shm_layout import FOLDER_MODE, header_file_name, version_file_name

log = logging.getLogger(__name__)


def server_shm_dir(port: int, root: Path | None = None) -> Path | None:
    """This server's own directory, <root>/weightserver-<port>-<random>-<pid> (unique even for
    several port-0 servers in one process), or None (shared memory off) when `root` (default
    /dev/shm) does not exist. Folders of servers that died uncleanly are removed first: it is memory."""
    root = Path("/dev/shm") if root is None else Path(root)
    if not root.is_dir():
        log.warning("shared-memory directory %s does not exist; same-host fetches will stream", root)
        return None
    for stale in root.glob("weightserver-*-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by a server that is gone", stale)
            shutil.rmtree(stale, ignore_errors=True)
    return root / f"weightserver-{port}-{secrets.token_hex(4)}-{os.getpid()}"


def _write_file(path: Path, data: bytes | bytearray | memoryview, mode: int) -> None:
    """Write `path` whole with `mode` (temp file + rename: a reader never sees part of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # left by a crash, and read-only if it was a header's
    with open(tmp, "wb") as f:
        f.write(memoryview(data))
    os.chmod(tmp, mode)
    tmp.replace(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedMemoryFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[tuple[str, int, int, str], Path] = {}

    def existing(self, key: tuple[str, int, int, str]) -> Path | None:
        """The file of payload `key` if it was written already."""
        with self._lock:
            return self._files.get(key)

    def path_for(self, key: tuple[str, int, int, str], data: bytes | bytearray | memoryview) -> Path:
        """The file holding `data` for payload `key` (model, version, base, dtype), written once."""
        with self._lock:
            path = self._files.get(key)
            if path is not None and path.exists():
                return path
            model, version, base, dtype = key
            suffix = (f"-delta{base}" if base else "") + (f"-{dtype}" if dtype else "")
            path = self.directory / model / version_file_name(version, suffix)
            path.parent.mkdir(mode=FOLDER_MODE, exist_ok=True)
            _write_file(path, data, 0o644)
            self._files[key] = path
            return path

    def new_upload(self, model: str, size: int) -> SharedMemoryUpload:
        """A fresh file of `size` bytes, mapped writable, for a publish to receive into: the
        version's bytes then live in shared memory from the start (no extra copy)."""
        directory = self.directory / model
        directory.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        path = directory / f"upload-{secrets.token_hex(8)}.tmp"
        return SharedMemoryUpload(path, size)

    def adopt(self, key: tuple[str, int, int, str], upload: SharedMemoryUpload) -> None:
        """Make a committed upload's file the payload file of `key`."""
        model, version, _, _ = key
        path = self.directory / model / version_file_name(version)
        os.chmod(upload.path, 0o444)  # the server serves from this memory: nobody should write it
        upload.path.replace(path)
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
            if content is not None:
                _write_file(self.directory / model / header_file_name(version), content, 0o444)

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


class SharedMemoryUpload:
    """A publish's receive buffer backed by a file in the shared-memory directory."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        with open(path, "w+b") as f:
            os.chmod(path, 0o644)
            f.truncate(size)
            # A zero-length file cannot be mapped; an empty upload gets a plain buffer.
            self.buffer: memoryview = memoryview(mmap.mmap(f.fileno(), size)) if size else memoryview(bytearray())

    def abort(self) -> None:
        self.path.unlink(missing_ok=True)
