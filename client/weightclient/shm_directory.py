"""SharedMemoryDirectory: a model's folder in a same-host server's shared memory, for reading
an exact version without asking the server where it is.

The server keeps each retained version of a model as `<folder>/<version:012d>.safetensors`,
and beside it `<version:012d>.header`: the version's `VersionInfo`, digests included, written
after the file and removed before it (weightserver.shared_memory). A client learns the folder
from a Negotiate reply that named a version's own file there; from then on a fetch of an
exact version costs two file reads instead of a gRPC round trip (about 1-2 ms on loopback,
more than the copy of a 16 MiB model). The bytes are still checked against the header's
digests, and anything unexpected (no header, an unparsable one, a file the server's user does
not own or others may write) sends the fetch back to the server.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from weightserver.shm_layout import header_file_name, version_file_name
from weightserver.v1 import weights_pb2 as pb

MAX_HEADER_BYTES = 64 << 20  # far above any real manifest; a larger file is not one of ours


@dataclass(frozen=True)
class SharedMemoryDirectory:
    """The folder holding one model's version files, and the user that owns it."""

    path: str
    owner: int

    @classmethod
    def learned_from(cls, file_path: str, version: int) -> SharedMemoryDirectory | None:
        """The folder of `file_path`, if it is `version`'s own file named the server's way and
        the folder is one only its owner can change; else None (read nothing directly)."""
        folder, name = os.path.split(file_path)
        if name != version_file_name(version):
            return None  # a delta or cast payload, or a server that names files otherwise
        try:
            st = os.stat(folder)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
            return None
        return cls(folder, st.st_uid)

    def file(self, version: int) -> str:
        return os.path.join(self.path, version_file_name(version))

    def header(self, model: str, version: int) -> pb.VersionInfo | None:
        """`version`'s header as the server wrote it, or None when it is not there (not yet
        committed, evicted, the server gone) or not to be trusted."""
        try:
            fd = os.open(os.path.join(self.path, header_file_name(version)), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != self.owner
                or st.st_mode & 0o022
                or st.st_size > MAX_HEADER_BYTES
            ):
                return None
            content = os.pread(fd, st.st_size, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            info = pb.VersionInfo.FromString(content)
        except DecodeError:
            return None
        if info.model != model or info.version != version or not info.xxh3:
            return None
        return info
