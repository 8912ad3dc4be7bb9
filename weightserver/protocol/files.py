"""File names on disk and in shared memory, a contract with same-host clients (the proto's
`SharedMemoryFile` states it): `<model>/<version:012d>.safetensors`, and beside it `.header`, its
`VersionInfo`, written after the file and removed before it. Derived payloads carry a suffix and
no header. Folders are mode 0755: a client trusts a header only where nobody else can write."""

from __future__ import annotations

FILE_SUFFIX = ".safetensors"
HEADER_SUFFIX = ".header"
FOLDER_MODE = 0o755


def version_file_name(version: int, suffix: str = "") -> str:
    """The name of a version's payload file in its model's folder (`suffix`: a delta or cast)."""
    return f"{version:012d}{suffix}{FILE_SUFFIX}"


def header_file_name(version: int) -> str:
    """The name of the header file beside a version's own file."""
    return f"{version:012d}{HEADER_SUFFIX}"
