"""Payload files in a same-host server's shared memory: a fetch maps one copy-on-write, or reads an
exact version by its header file with no call (`read_directly`); a publish writes the server's upload memfd."""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import re
import stat
import threading
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import ClassVar

import xxhash
from google.protobuf.message import DecodeError

from weightclient.core.retry import Deadline
from weightclient.placement import layout, mismatched
from weightclient.transports import base
from weightclient.transports.base import Offer, Parts, PayloadGone, Progress, Transport, TransportFailed, Uploaded
from weightclient.transports.block_reader import read_blocks
from weightserver.protocol import cpus, page_tables
from weightserver.protocol.digests import BLOCK_BYTES, PREFIX_BYTES, IncomingDigests, xxh3_hex
from weightserver.protocol.errors import DeadlineExceeded, InvalidSafetensors
from weightserver.protocol.files import header_file_name, version_file_name
from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb

MAX_HEADER_BYTES = 64 << 20  # far above any real manifest; a larger file is not one of ours
WRITE_BLOCK = 1 << 20  # a publish writes, then hashes, this much at a time: the hash finds it in cache
UNMAP_FROM = 64 << 20  # an upload this large is written by 2+ threads and unmapped an eighth at a time
COPY_STEP = 256 << 10  # one thread copies, then hashes, this much at a time: the hash finds it in L2
COPY_THREADS = 4  # at most this many copy a large upload (one per core but two; two on fewer than 4 cores)
HASH_RUN = 16  # blocks hashed at once at most: with 5+ cores, the file's digest of a run goes to a thread of its own
UPLOAD_FILE = re.compile(r"upload-[0-9a-f]+\.tmp")  # a link to a memfd of the server's, sealed at `uploaded`
UPLOAD_MEMORY = re.compile(r"/proc/[0-9]+/fd/[0-9]+")


class SharedMemoryTransport(Transport):
    name: ClassVar[str] = "shm"
    kind: ClassVar[int] = pb.TRANSPORT_SHARED_MEMORY

    def __init__(self) -> None:
        self._folders: dict[str, tuple[str, int]] = {}  # model -> (folder, owner), once a file was read
        self._prepared: dict[str, mmap.mmap] = {}  # upload path -> its mapping, page table filled (dict ops are atomic)
        self._sealed: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # mappings of sealed files

    def upload(self, payload: pb.Payload, parts: Parts, *, deadline: Deadline, progress: Progress | None) -> Uploaded:
        """`_UploadWrite` through the upload file's mapping (set up ahead by `prepare`, else now), unmapped after."""
        path, total = payload.shared_memory.path, payload.byte_size
        if sum(p.nbytes for p in parts) != total:
            raise TransportFailed(f"{path} is not an upload file of {total} bytes")
        mapping = self._prepared.pop(path, None) or self._mapped(path, total)
        with mapping, memoryview(mapping) as target:
            return _UploadWrite(target, mapping, parts, deadline, progress).run()

    def prepare(self, payload: pb.Payload) -> None:
        """Map the upload file and fill the page table now (about 0.25 ms per MiB)."""
        path = payload.shared_memory.path
        self._prepared[path] = self._mapped(path, payload.byte_size)  # (each upload is named afresh: none is held)

    def release(self, payload: pb.Payload) -> None:
        mapping = self._prepared.pop(payload.shared_memory.path, None)
        if mapping is not None:
            mapping.close()

    def _mapped(self, path: str, total: int) -> mmap.mmap:
        """The upload mapped, page table filled: TransportFailed unless named as the server names uploads
        (nothing else is written to), a link to a server's memfd (in no folder) of `total` bytes."""
        try:
            memory = os.readlink(path) if UPLOAD_FILE.fullmatch(os.path.basename(path)) else ""
            if not UPLOAD_MEMORY.fullmatch(memory):
                raise TransportFailed(f"{path} is not an upload of {total} bytes")
            fd = os.open(memory, os.O_RDWR)
        except OSError as exc:
            _check_visible(path)
            raise TransportFailed(f"cannot open {path} for writing here ({exc})") from exc
        try:
            st = os.fstat(fd)
            if os.stat(path).st_ino != st.st_ino:  # the link is removed before its number is reused
                raise TransportFailed(f"{path} went while it was opened")
            if not stat.S_ISREG(st.st_mode) or st.st_size != total or st.st_nlink != 0:
                raise TransportFailed(f"{path} is not an upload file of {total} bytes")
            mapping = mmap.mmap(fd, total)
        except OSError as exc:
            raise TransportFailed(f"cannot write {path}: {exc}") from exc
        finally:
            os.close(fd)
        mapping.madvise(mmap.MADV_DONTFORK)  # a child forked meanwhile would hold it writable: no seal
        page_tables.populate(mapping)  # before Linux 5.14 it does nothing: the copy takes the faults
        return mapping

    def receive(self, offer: Offer, *, into: base.Into, progress: Progress | None) -> memoryview:
        """The file mapped copy-on-write: no copy, private writes, valid after removal (a Sink: read, then unmapped)."""
        size, sink = offer.payload.byte_size, base.is_sink(into)
        with self._opened(offer) as fd:
            data = memoryview(bytearray())  # mmap cannot map an empty file
            if size:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if sink:
                    with mapping, memoryview(mapping) as view:
                        data = base.into_sink(view, into)
                else:
                    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE:
                        self._sealed.add(mapping)
                    data = memoryview(mapping)
        self._learn(offer)
        return data

    def sealed(self, data: memoryview) -> bool:
        return data.obj in self._sealed

    def receive_placed(self, offer: Offer, views: Mapping[str, memoryview]) -> list[str]:
        with self._opened(offer) as fd:
            bad = _read_placed(fd, offer.info, views)
        if not bad:
            self._learn(offer)
        return bad

    @contextmanager
    def _opened(self, offer: Offer) -> Iterator[int]:
        path, size = offer.payload.shared_memory.path, offer.payload.byte_size
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            if not os.path.exists(path) and os.path.isdir(os.path.dirname(path)):  # evicted: ask again
                raise PayloadGone(f"{path} was removed before it could be read") from exc
            _check_visible(path)
            raise TransportFailed(f"cannot open {path} here ({exc})") from exc
        try:
            if os.fstat(fd).st_size != size:
                raise TransportFailed(f"{path} is not {size} bytes long")
            yield fd
        except (OSError, ValueError) as exc:
            raise TransportFailed(f"cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)

    def read_directly(self, model: str, version: int) -> Offer | None:
        """An offer for exactly `version` from its header file as the server wrote it; None when absent or untrusted."""
        folder, owner = self._folders.get(model, ("", -1))
        if not folder:
            return None
        try:
            fd = os.open(os.path.join(folder, header_file_name(version)), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                trusted = stat.S_ISREG(st.st_mode) and st.st_uid == owner and not st.st_mode & 0o022
                if not trusted or st.st_size > MAX_HEADER_BYTES:
                    return None
                header = pb.VersionInfo.FromString(os.pread(fd, st.st_size, 0))
            finally:
                os.close(fd)
        except (OSError, DecodeError):
            return None
        if header.model != model or header.version != version or not header.xxh3:
            return None
        info, path = VersionInfo.from_proto(header), os.path.join(folder, version_file_name(version))
        payload = pb.Payload(byte_size=info.byte_size, xxh3=info.xxh3, shared_memory=pb.SharedMemoryFile(path=path))
        return Offer(info, payload)

    def _learn(self, offer: Offer) -> None:
        """Remember the folder of a version's own file and its owner, if only the owner can change it."""
        folder, name = os.path.split(offer.payload.shared_memory.path)
        if not offer.whole_version or name != version_file_name(offer.info.version):
            return  # a delta or cast payload, or a server that names files otherwise
        try:
            st = os.stat(folder)
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022:
            self._folders[offer.info.model] = (folder, st.st_uid)


class _UploadWrite:
    """`parts` copied into the mapping `target` a block at a time, each block hashed there (file and tensors, in file
    order, while in cache): the digests describe the bytes the server seals. From UNMAP_FROM, two threads copy (6 GB/s
    here for one, 12 for two; up to COPY_THREADS where there are cores), and each eighth once hashed is unmapped by the
    thread that hashed its end while the others go on: else the seal waits for the page tables' teardown (11-19 ms at
    256 MiB). Each thread copies the next block with the GIL let go; whichever finds the next block copied and nobody
    hashing hashes the run of copied blocks from there and reports it, so none waits on a thread that may have lost its
    core. On 5+ cores the file's digest of each run is taken on a thread of its own while the hashing thread takes the
    tensors' (two passes of xxh3 at once: there the hash, not the copy, bounds a large upload). A thread that fails
    stops the others."""

    def __init__(
        self, target: memoryview, mapping: mmap.mmap, parts: Parts, deadline: Deadline, progress: Progress | None
    ) -> None:
        self.target, self.mapping, self.deadline, self.progress = target, mapping, deadline, progress
        self.found: IncomingDigests | None = IncomingDigests(target)
        sources = list(base.blocks(parts, WRITE_BLOCK, None))
        offsets = itertools.accumulate((b.nbytes for b in sources), initial=0)
        self.jobs = list(zip(offsets, sources, strict=False))  # (offset in the file, source block)
        self.window = -(-target.nbytes // 8 // mmap.PAGESIZE) * mmap.PAGESIZE if target.nbytes >= UNMAP_FROM else 0
        self.step = WRITE_BLOCK if self.window else COPY_STEP  # (two threads: a block's turn comes as it ends)
        cores = cpus.usable_cpus()
        self.writers = 1 if not self.window else 2 if cores < 4 else min(cores - 2, COPY_THREADS)
        self.spans: ThreadPoolExecutor | None = None  # where the file's digest of a run is taken, with 5+ cores
        self.given_up = 0  # bytes [0, given_up) are unmapped, or are being
        self.copied = [False] * len(self.jobs)
        self.taken = self.turn = 0  # blocks taken by a thread; blocks hashed
        self.hashing = self.failed = False  # a thread hashes at `turn`; a thread failed
        self.changed = threading.Condition()

    def run(self) -> Uploaded:
        wide = self.writers > 2  # (a thread beside the writers takes the file's digests: none of them waits for it)
        if self.writers == 1:
            self.blocks()
        else:
            with ThreadPoolExecutor(self.writers - 1 + wide, thread_name_prefix="weightclient-copy") as helpers:
                self.spans = helpers if wide else None
                others = [helpers.submit(self.blocks) for _ in range(self.writers - 1)]
                self.blocks()
                for other in others:
                    other.result()
        if self.found is None:
            return Uploaded(xxh3_hex(self.target))  # (nothing was unmapped: `found` fails at the header)
        digests = self.found.finish()
        return Uploaded(digests.xxh3, digests.tensor_xxh3)

    def blocks(self) -> None:
        """Copy blocks until none is left, `step` bytes at a time, then hash as far as they are copied. In a block's
        turn (one thread, below UNMAP_FROM) each step is hashed as soon as copied, in this core's cache (4.8 against
        5.4 ms at 16 MiB); with two threads a block's turn comes as its copy ends, and it is hashed then."""
        import numpy  # (here: a client that only fetches starts without it)

        target = numpy.frombuffer(self.target, numpy.uint8)
        try:
            while True:
                with self.changed:
                    j, self.taken = self.taken, min(self.taken + 1, len(self.jobs))
                    while j == len(self.jobs) and not self._done() and (self.hashing or not self.copied[self.turn]):
                        self.changed.wait()  # nothing left to copy: the hashing waits for another's block
                    if self._done():
                        return
                if j < len(self.jobs):
                    at, block = self.jobs[j]
                    self._in_time(at)
                    source = numpy.frombuffer(block, numpy.uint8)
                    for start in range(0, block.nbytes, self.step):
                        stop = min(start + self.step, block.nbytes)
                        numpy.copyto(target[at + start : at + stop], source[start:stop])
                        if self.turn == j and stop < block.nbytes:  # (one thread: nobody else moves it on)
                            self._hash(at + stop)
                    with self.changed:
                        self.copied[j] = True
                self._advance()
        except BaseException:
            with self.changed:
                self.failed = True
                self.changed.notify_all()
            raise
        finally:
            del target

    def _done(self) -> bool:
        return self.failed or self.turn == len(self.jobs)

    def _advance(self) -> None:
        """Hash the copied blocks from `turn` on, a run of up to HASH_RUN at a time, unless another thread is; stop at
        one not copied yet, or to unmap the windows that fell due (another thread takes over the hashing meanwhile)."""
        with self.changed:
            if self.hashing or self._done() or not self.copied[self.turn]:
                return
            self.hashing = True
        due = None
        try:
            while due is None:
                with self.changed:
                    end = self.turn + 1
                    while end < min(len(self.jobs), self.turn + HASH_RUN) and self.copied[end]:
                        end += 1
                self._in_time(self.jobs[self.turn][0])
                at, block = self.jobs[end - 1]
                due = self._hashed(at + block.nbytes)
                with self.changed:
                    self.turn = end
                    if self._done() or not self.copied[self.turn]:
                        break
        finally:
            with self.changed:
                self.hashing = False
                self.changed.notify_all()
        if due is not None:
            page_tables.unmap(self.mapping, *due)

    def _in_time(self, at: int) -> None:
        if self.deadline.expired():
            raise DeadlineExceeded(f"writing the upload took longer than the call's timeout (at byte {at})")

    def _hash(self, end: int) -> None:
        if self.found is not None:
            try:
                self.found.advance(end, spans=self.spans)
            except InvalidSafetensors:
                self.found = None  # not a safetensors file: the server says so, with its own error

    def _hashed(self, end: int) -> tuple[int, int] | None:
        """Hash bytes up to `end` (in its turn); the range of the windows now due for unmapping, if any."""
        self._hash(end)
        if self.progress is not None:
            self.progress(end, self.target.nbytes)
        start = self.given_up
        while self.window and self.found is not None and self.found.parsed and end - self.given_up >= 2 * self.window:
            self.given_up += self.window
        return (start, self.given_up) if self.given_up > start else None


def _check_visible(path: str) -> None:
    """NotVisibleHere unless the server's folder (`<shm dir>/<server's folder>/<model>/<file>`) is there."""
    folder = os.path.dirname(os.path.dirname(path))
    if not os.path.isdir(folder):
        raise base.NotVisibleHere(
            f"its shared memory ({folder}) is not visible from this process (another host, container or mount "
            "namespace); fetches and publishes use bulk or the stream"
        )


def _read_placed(fd: int, info: VersionInfo, views: Mapping[str, memoryview]) -> list[str]:
    prefix = os.pread(fd, PREFIX_BYTES, 0)
    if len(prefix) != PREFIX_BYTES:
        raise ValueError("the file is shorter than a safetensors header")
    offset = PREFIX_BYTES
    blocks: list[tuple[memoryview, int]] = []
    owners: list[str] = []
    for size, name in layout(info, views, int.from_bytes(prefix, "little")):
        if name is not None:
            for start in range(0, size, BLOCK_BYTES):
                blocks.append((views[name][start : start + BLOCK_BYTES], offset + start))
                owners.append(name)
        offset += size
    hashers = {name: xxhash.xxh3_128() for name in views}
    read_blocks(fd, blocks, lambda i: hashers[owners[i]].update(blocks[i][0]))
    return mismatched(info, hashers)
