"""Page tables: first touches fault, about 0.25 ms per MiB of small pages, as much as copying
the bytes. `populate` fills a shared mapping's ahead of use (MADV_POPULATE_WRITE changes no byte,
so it is safe while another process writes; through ctypes, which lets go of the GIL, where
mmap.madvise holds it; kernels before 5.14 refuse it and the faults come with the bytes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

MADV_POPULATE_WRITE = 23  # Linux 5.14
SHMEM_HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_SETTINGS = ("advise", "within_size", "always", "force")  # of SHMEM_HUGE_PAGES: the ones that give huge pages
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
MAP_FIXED, PROT_NONE = 0x10, 0x0  # (not in the mmap module)


def anonymous(size: int, *, huge: bool = False) -> memoryview:
    """`size` bytes of fresh private memory to receive into (mmap's default, shared shmem, fills 40% slower).
    `huge`: advised as huge pages, for memory kept and reused (a follower's cut-through buffer): a collector's
    small pages made the server's page-table fill of the next upload 3 to 10 times slower (docs/performance.md)."""
    if not size:
        return memoryview(bytearray())
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    if huge:
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(memory)


def populate(mapping: mmap.mmap) -> bool:
    """Map every page of the writable shared `mapping` now; whether the kernel did. Advised as huge
    pages first: where the host allows them (`shared_huge_pages`), the fill is 15 times faster and the
    unmap (which the seal of an upload waits for) 200 times; elsewhere the advice changes nothing."""
    if not len(mapping):
        return True
    anchor = ctypes.c_char.from_buffer(mapping)  # keeps the mapping open while it is in use
    try:
        _libc.madvise(ctypes.addressof(anchor), len(mapping), mmap.MADV_HUGEPAGE)  # (refused: small pages)
        return _libc.madvise(ctypes.addressof(anchor), len(mapping), MADV_POPULATE_WRITE) == 0
    finally:
        del anchor


def reserve(fd: int, size: int) -> None:
    """Allocate `size` bytes of the memfd `fd` now (OSError when there is no room, not a writer's SIGBUS
    later): through an advised mapping (`populate`) where the host gives shared memory huge pages only on
    advice, as fallocate would take small pages; elsewhere fallocate ("always", "within_size": huge too)."""
    if size and shared_huge_pages() == "advise":
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mapping:
            if populate(mapping):
                return
    if size:
        os.posix_fallocate(fd, 0, size)


def shared_huge_pages() -> str | None:
    """The host's huge-page setting for shared memory (tmpfs, memfd): HUGE_SETTINGS give them; None: unknown."""
    try:
        with open(SHMEM_HUGE_PAGES) as f:
            setting = f.read()
    except OSError:
        return None
    chosen = setting[setting.find("[") + 1 : setting.find("]")] if "[" in setting else setting.strip()
    return chosen or None


def unmap(mapping: mmap.mmap, start: int, end: int) -> None:
    """Replace bytes [start, end) of `mapping` (page-aligned) with inaccessible anonymous memory off the
    GIL, so tearing the file's pages down overlaps other work; unlike a munmap, it leaves no hole another
    mapping could take before `mapping.close()`. Never touch that range afterwards."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        at = ctypes.addressof(anchor) + start
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED
        if _libc.mmap(at, end - start, PROT_NONE, flags, -1, 0) != at:
            raise OSError(ctypes.get_errno(), "mmap(MAP_FIXED) over an upload's mapping failed")
    finally:
        del anchor
