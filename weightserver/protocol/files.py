"""The shared-memory folder layout: a contract between a server and same-host clients.

A server with shared memory keeps each retained version of a model as
`<its folder>/<model>/<version:012d>.safetensors`, byte for byte the version's file, and
beside it `<version:012d>.header`: the version's `VersionInfo` message as Fetch and Negotiate
send it, written after the file (and again on a pin) and removed before it. Derived payloads
(deltas, casts) carry a suffix before `.safetensors` and have no header. Folders are mode
0755 and files 0444 or 0644, owned by the server's user: a client trusts a header only in a
folder that nobody else can write. The proto's `SharedMemoryFile` comment says the same for
clients in other languages.
"""

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
