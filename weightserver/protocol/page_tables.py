"""Fill a process's page table for a shared-memory mapping ahead of use (both sides use it).

A fresh mapping of a /dev/shm file takes a page fault per 4 KiB page on first touch, about
0.25 ms per MiB here: as much as copying the bytes. An upload set up before its bytes come
(a spare, or the server's side of any staged upload) pays that ahead with
MADV_POPULATE_WRITE, which maps every page writable and changes no byte, so it is safe while
another thread or process writes the file. It is called through ctypes, which lets go of the
GIL (mmap.madvise holds it for the whole call); kernels before 5.14 refuse it, and then the
faults are taken as the bytes come.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def populate(mapping: mmap.mmap) -> bool:
    """Map every page of the writable shared `mapping` now; whether the kernel did."""
    if not len(mapping):
        return True
    anchor = ctypes.c_char.from_buffer(mapping)  # keeps the mapping open while it is in use
    try:
        return _libc.madvise(ctypes.addressof(anchor), len(mapping), MADV_POPULATE_WRITE) == 0
    finally:
        del anchor
