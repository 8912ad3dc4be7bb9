"""Issue 5, bad input: every bad call gets the right status code and a message that names the
problem (the limit and the actual value, the tensor, the cursor), while a fetcher on ANOTHER
client keeps fetching in a thread DURING the bad call and only ever gets the last good version's
exact bytes.

Raw publish streams pause halfway until that fetcher has completed fetches, so the fetches
provably overlap the bad call on the server. test_errors.py covers the client's exception type
and trailer for every error-table row with a check afterwards; this file adds the concurrent
fetcher, the server-side header limits, size mismatches far larger than the bytes sent, racing
publishers with a fetcher watching for mixed versions, deadlines, bogus watch cursors, and
property tests of a damaged --data-dir (a damaged version is skipped, the rest are served).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import wait_equal, wait_until

from tests.integration.test_errors import chunks, commit, header_request, raises_rpc, raw_raises, watch_publish_start
from weightclient import (
    CursorOutOfRange,
    DeadlineExceeded,
    FetchedBytes,
    IntegrityError,
    InvalidRequest,
    InvalidSafetensors,
    ModelNotFound,
    ModelTooLarge,
    VersionConflict,
    VersionEvicted,
    VersionNotFound,
    WeightServiceClient,
)
from weightserver.protocol.safetensors_format import DTYPE_SIZES, build_header, parse_header
from weightserver.protocol.version_info import version_message
from weightserver.storage.store import VersionStore
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
WAIT = 10.0
BIG = 1 << 20  # a 1 MiB leading tensor: uploads of 16+ chunks, so a stream can pause halfway
STORE_LOGGER = "weightserver.storage"


# ---------------------------------------------------------------------- files
def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def st_file(tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None) -> bytes:
    """A valid safetensors file from (name, dtype, shape, raw bytes)."""
    prefix, _ = build_header([(name, dtype, shape, len(raw)) for name, dtype, shape, raw in tensors], metadata)
    return prefix + b"".join(raw for *_, raw in tensors)


def good_file(n: int, numel: int = 16 * 1024) -> bytes:
    """A valid ~64 KiB file whose bytes are distinct for every n."""
    return st_file([("w", "F32", (numel,), struct.pack("<f", n) * numel), ("n", "I64", (), struct.pack("<q", n))])


def framed(header: dict | bytes, data_len: int) -> bytes:
    """An 8-byte length, `header` (JSON-encoded unless bytes, padded to 8) and `data_len` data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data_len)


def spec(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


LEAD = {"lead": spec("U8", [BIG], 0, BIG)}


# ---------------------------------------------------------------------- the concurrent fetcher
class FetchLoop:
    """Fetches the latest version of `model` over and over on its own client in a thread.

    Each result goes through `check` (default: its bytes must be exactly `expected[version]`);
    problems and exceptions are collected in `errors`, never raised in the thread.
    """

    def __init__(
        self,
        address: str,
        model: str = MODEL,
        expected: dict[int, bytes] | None = None,
        check: Callable[[FetchedBytes], str | None] | None = None,
    ) -> None:
        self.address = address
        self.model = model
        self.expected = expected or {}
        self.check = check or self._check_expected
        self.errors: list[str] = []
        self.versions: list[int] = []
        self.fetches = 0
        self.held = False  # set by hold(): fetches completed while a bad call was open
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-loop", daemon=True)

    def _check_expected(self, fetched: FetchedBytes) -> str | None:
        expected = self.expected.get(fetched.info.version)
        if expected is None:
            return f"fetched v{fetched.info.version}; only {sorted(self.expected)} may be served"
        if bytes(fetched.data) != expected:
            return f"v{fetched.info.version}: sha256 {sha(fetched.data)} is not what was published ({sha(expected)})"
        return None

    def _run(self) -> None:
        # Alternate the plain gRPC stream with "auto" (shared memory / bulk on this host).
        with WeightServiceClient(self.address) as client:
            for transport in itertools.cycle(("stream", "auto")):
                if self._stop.is_set():
                    return
                try:
                    fetched = client.fetch_bytes(self.model, transport=transport, timeout=WAIT)
                    assert fetched is not None
                    problem = self.check(fetched)
                    if problem:
                        self.errors.append(f"{transport} fetch: {problem}")
                    if self.versions and fetched.info.version < self.versions[-1]:
                        self.errors.append(f"latest went back from v{self.versions[-1]} to v{fetched.info.version}")
                    self.versions.append(fetched.info.version)
                except Exception as exc:
                    self.errors.append(f"{transport} fetch raised {type(exc).__name__}: {exc}")
                with self._progress:
                    self.fetches += 1
                    self._progress.notify_all()
                time.sleep(0.001)  # leave the GIL to the server and the bad caller

    def wait_for(self, count: int, timeout: float = WAIT) -> bool:
        """Wait until `count` more fetches have completed; False on timeout."""
        with self._progress:
            target = self.fetches + count
            return self._progress.wait_for(lambda: self.fetches >= target or not self._thread.is_alive(), timeout)

    def hold(self) -> None:
        """Called from inside a bad call (e.g. a publish request generator): wait for 3 fetches."""
        self.held = self.wait_for(3)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        assert not self._thread.is_alive(), "the fetch loop did not stop"


@contextlib.contextmanager
def fetching(address: str, expected: dict[int, bytes] | None = None, **kwargs) -> Iterator[FetchLoop]:
    """Run a FetchLoop on another client around the block; then assert it never failed, fetched
    before and after the block, and only ever got good bytes."""
    loop = FetchLoop(address, expected=expected, **kwargs)
    loop.start()
    try:
        assert loop.wait_for(1), f"the fetcher could not fetch before the bad call: {loop.errors}"
        yield loop
        assert loop.wait_for(2), f"the fetcher stalled after the bad call: {loop.errors}"
    finally:
        loop.stop()
    assert not loop.errors, f"{len(loop.errors)} of {loop.fetches} concurrent fetches failed: {loop.errors[:5]}"


def publish_stream(
    model: str,
    data: bytes,
    *,
    during: Callable[[], None] | None = None,
    total_bytes: int | None = None,
    sha256: str | None = None,
    send: bytes | None = None,
) -> Iterator[pb.PublishRequest]:
    """A raw Publish stream: header, the first half of the chunks of `send` (default: `data`),
    `during()` while the call is open on the server, the rest, commit."""
    parts = chunks(data if send is None else send)
    yield header_request(model, data, total_bytes=total_bytes, sha256=sha256)
    yield from parts[: len(parts) // 2]
    if during is not None:
        during()
    yield from parts[len(parts) // 2 :]
    yield commit()


def assert_unchanged(client: WeightServiceClient, versions: dict[int, bytes]) -> None:
    """The model holds exactly `versions`, byte for byte, and the next publish takes the next
    number (a failed call took none)."""
    assert [v.version for v in client.list_versions(MODEL)] == sorted(versions)
    for version, data in versions.items():
        fetched = client.fetch_bytes(MODEL, version=version, transport="stream")
        assert fetched is not None and bytes(fetched.data) == data
    next_number = max(versions) + 1
    assert client.publish_bytes(MODEL, good_file(next_number, numel=256)).version == next_number


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def good(client) -> dict[int, bytes]:
    """Versions 1 and 2 of MODEL, published; returns version -> bytes."""
    files = {1: good_file(1), 2: good_file(2)}
    for version, data in files.items():  # over the stream: no upload is set up ahead
        assert client.publish_bytes(MODEL, data, transport="stream").version == version
    return files


@pytest.fixture
def stub(server) -> Iterator[pb_grpc.WeightServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.WeightServiceStub(channel)


@pytest.fixture
def custom(make_server) -> Iterator[Callable]:
    """custom(**settings) -> (server, client, stub) on a server with those settings."""
    opened: list = []

    def factory(**settings):
        srv = make_server(**settings)
        client = WeightServiceClient(srv.address)
        channel = grpc.insecure_channel(srv.address)
        opened.extend((client, channel))
        return srv, client, pb_grpc.WeightServiceStub(channel)

    yield factory
    for thing in opened:
        thing.close()


# ---------------------------------------------------------------------- malformed safetensors
MALFORMED = {
    "invalid_json": (
        framed(b'{"lead": {"dtype": "U8", "shape": [1048576], "data_offsets": [0, 1048576]},, }', BIG),
        ("header is not valid JSON", "line 1 column"),
    ),
    "unknown_dtype": (
        framed({**LEAD, "w": spec("F7", [1], BIG, BIG + 4)}, BIG + 4),
        ("tensor 'w'", "unknown dtype 'F7'", "known: BOOL, U8"),
    ),
    "shape_not_matching_bytes": (
        framed({**LEAD, "w": spec("F32", [3], BIG, BIG + 8)}, BIG + 8),
        ("tensor 'w'", "shape [3] of F32 needs 12 bytes", f"[{BIG}, {BIG + 8}] span 8"),
    ),
    "offsets_out_of_bounds": (
        framed({**LEAD, "w": spec("F32", [2], BIG, BIG + 8)}, BIG + 4),
        ("tensor 'w'", f"[{BIG}, {BIG + 8}]", f"run past the {BIG + 4}-byte data section"),
    ),
    "offsets_overlapping": (
        framed({**LEAD, "a": spec("F32", [2], BIG, BIG + 8), "b": spec("F32", [2], BIG + 4, BIG + 12)}, BIG + 12),
        ("tensor 'b'", f"[{BIG + 4}, {BIG + 12}] overlap", f"ends at {BIG + 8}"),
    ),
    "offsets_overlapping_the_first_tensor": (
        framed({**LEAD, "w": spec("U8", [4], BIG - 4, BIG)}, BIG),
        ("overlap", f"ends at {BIG}"),
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_while_another_client_fetches(server, client, stub, good, case: str) -> None:
    data, fragments = MALFORMED[case]
    with (
        fetching(server.address, {2: good[2]}) as fetcher,
        raw_raises(InvalidSafetensors, grpc.StatusCode.INVALID_ARGUMENT, *fragments),
    ):
        stub.Publish(publish_stream(MODEL, data, during=fetcher.hold), timeout=WAIT * 3)
    assert fetcher.held, "no fetch completed while the bad publish was open"
    assert_unchanged(client, good)


# ---------------------------------------------------------------------- header limits
def test_header_over_max_header_bytes(custom) -> None:
    ok = st_file([("lead", "U8", (BIG,), bytes(BIG)), ("w", "F32", (2,), bytes(8))], {"note": "x"})
    limit = parse_header(ok).data_start - 8
    srv, client, _ = custom(max_header_bytes=limit)
    assert client.publish_bytes(MODEL, ok).version == 1  # a header of exactly the limit is accepted
    too_big = st_file([("lead", "U8", (BIG,), bytes(BIG)), ("w", "F32", (2,), bytes(8))], {"note": "x" * 100})
    size = parse_header(too_big).data_start - 8
    huge_length_field = struct.pack("<Q", 2**63) + b"{}      "

    with fetching(srv.address, {1: ok}):
        with raises_rpc(
            InvalidSafetensors,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"header is {size} bytes",
            f"over the limit of {limit}",
        ):
            client.publish_bytes(MODEL, too_big)
        with raises_rpc(
            InvalidSafetensors, grpc.StatusCode.INVALID_ARGUMENT, f"header is {2**63} bytes", f"limit of {limit}"
        ):
            client.publish_bytes(MODEL, huge_length_field)
    assert_unchanged(client, {1: ok})


def test_too_many_tensors(custom) -> None:
    srv, client, _ = custom(max_tensors=4)

    def file(count: int) -> bytes:
        tensors = [("lead", "U8", (BIG,), bytes(BIG))] + [(f"t{i}", "F32", (1,), bytes(4)) for i in range(count - 1)]
        return st_file(tensors, {"step": "1"})

    assert client.publish_bytes(MODEL, file(4)).version == 1  # the limit itself; metadata does not count
    with fetching(srv.address, {1: file(4)}):
        for count in (5, 50):
            with raises_rpc(
                InvalidSafetensors,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"header lists {count} tensors",
                "over the limit of 4 tensors",
            ):
                client.publish_bytes(MODEL, file(count))
    assert_unchanged(client, {1: file(4)})


# ---------------------------------------------------------------------- size and digest
def test_fewer_bytes_than_declared_while_another_client_fetches(server, client, stub, good) -> None:
    data = framed(LEAD, BIG)
    sent = len(data) - 1000
    with (
        fetching(server.address, {2: good[2]}) as fetcher,
        raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, f"declared {len(data)} bytes but sent {sent}"),
    ):
        stub.Publish(publish_stream(MODEL, data, send=data[:sent], during=fetcher.hold), timeout=WAIT * 3)
    assert fetcher.held
    assert_unchanged(client, good)


def test_more_bytes_than_declared_while_another_client_fetches(server, client, stub, good) -> None:
    data = framed(LEAD, BIG)
    declared = len(data) - 8
    with (
        fetching(server.address, {2: good[2]}) as fetcher,
        raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, f"declared {declared} bytes but sent more"),
    ):
        stub.Publish(publish_stream(MODEL, data, total_bytes=declared, during=fetcher.hold), timeout=WAIT * 3)
    assert fetcher.held
    assert_unchanged(client, good)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("shm_dir", [None, "auto"], ids=["no-shm", "shm"])
def test_declared_size_far_above_bytes_sent_reserves_no_memory(custom, shm_dir) -> None:
    """A header that claims 1 GiB (under --max-model-bytes) and sends nothing must not make the
    server hold 1 GiB: a few such streams would exhaust its memory for every other client."""
    srv, client, stub = custom(shm_dir=shm_dir)
    assert client.publish_bytes(MODEL, good_file(1)).version == 1
    declared = 1 << 30
    started = watch_publish_start(srv)
    release = threading.Event()

    def requests():
        yield pb.PublishRequest(header=pb.PublishHeader(model=MODEL, total_bytes=declared, sha256="0" * 64))
        release.wait(WAIT)

    before = _resident_bytes()
    future = stub.Publish.future(requests(), timeout=WAIT * 3)
    try:
        with fetching(srv.address, {1: good_file(1)}) as fetcher:
            assert started.wait(WAIT)
            # The server handles the header on its event loop right after check_publish; a
            # fetch completed after that ran after it.
            assert fetcher.wait_for(2)
            grown = _resident_bytes() - before
    finally:
        release.set()
    with pytest.raises(grpc.RpcError) as info:
        future.result()
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert f"declared {declared} bytes but sent 0" in info.value.details()
    assert grown < 128 << 20, f"the server grew by {grown >> 20} MiB for a header that sent no bytes"
    assert_unchanged(client, {1: good_file(1)})


def test_digest_mismatch_while_another_client_fetches(server, client, stub, good) -> None:
    data = framed(LEAD, BIG)
    wrong = "ab" * 32
    with (
        fetching(server.address, {2: good[2]}) as fetcher,
        raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, f"received bytes is {sha(data)}", wrong),
    ):
        stub.Publish(publish_stream(MODEL, data, sha256=wrong, during=fetcher.hold), timeout=WAIT * 3)
    assert fetcher.held
    assert_unchanged(client, good)


def test_oversized_model_is_refused_on_its_header(custom) -> None:
    """The size check runs on the header: the server answers before a single chunk is read."""
    limit = 64 * 1024
    srv, client, stub = custom(max_model_bytes=limit)
    small = good_file(1, numel=1024)
    assert client.publish_bytes(MODEL, small).version == 1
    data = framed(LEAD, BIG)
    release = threading.Event()
    chunks_sent: list[bool] = []

    def requests():
        yield header_request(MODEL, data)
        release.wait(WAIT)
        chunks_sent.append(True)
        yield from chunks(data)
        yield commit()

    with fetching(srv.address, {1: small}):
        try:
            with raw_raises(
                ModelTooLarge,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(data)} bytes is over the server's limit of {limit} bytes",
                "--max-model-bytes",
            ):
                stub.Publish(requests(), timeout=WAIT * 3)
            assert chunks_sent == [], "the server waited for the chunks of a publish it must refuse"
        finally:
            release.set()
    assert_unchanged(client, {1: small})


# ---------------------------------------------------------------------- cancelled publish
def test_cancel_mid_publish_while_another_client_fetches(server, client, stub, good) -> None:
    data = good_file(3, numel=BIG // 4)
    started = threading.Event()
    release = threading.Event()
    shm = getattr(server, "shared_memory", None)
    uploads = (lambda: list(shm.directory.rglob("upload-*"))) if shm is not None else list
    open_uploads: list[list[Path]] = []

    with fetching(server.address, {2: good[2]}) as fetcher:

        def requests():
            yield header_request(MODEL, data)
            parts = chunks(data)
            yield from parts[: len(parts) // 2]
            fetcher.hold()
            open_uploads.append(uploads())
            started.set()
            release.wait(WAIT)  # never sends the rest: cancelled first

        future = stub.Publish.future(requests(), timeout=WAIT * 3)
        try:
            assert started.wait(WAIT)
            assert future.cancel()
        finally:
            release.set()
        assert future.code() == grpc.StatusCode.CANCELLED
    assert fetcher.held
    if shm is not None:
        assert len(open_uploads[0]) == 1  # the half-received upload was in shared memory ...
        # ... and is gone.
        wait_equal(uploads, [], timeout=WAIT, what="no upload file of the cancelled publish in shared memory")
    assert_unchanged(client, good)


# ---------------------------------------------------------------------- lookups of what is not there
def test_unknown_evicted_and_deleted_lookups_never_disturb_a_fetcher(custom) -> None:
    srv, client, stub = custom(keep=2)
    for n in range(1, 5):
        assert client.publish_bytes(MODEL, good_file(n)).version == n
    client.delete(MODEL, 3)  # retained: 4; evicted: 1, 2; deleted: 3
    cases = [
        (lambda: list(stub.Fetch(pb.FetchRequest(model="ghost"))), ModelNotFound, "no model 'ghost'", "'policy'"),
        (lambda: stub.GetLatest(pb.GetLatestRequest(model="ghost")), ModelNotFound, "no model 'ghost'"),
        (lambda: list(stub.Fetch(pb.FetchRequest(model=MODEL, version=99))), VersionNotFound, "no version 99"),
        (lambda: list(stub.Fetch(pb.FetchRequest(model=MODEL, version=1))), VersionEvicted, "oldest retained is 4"),
        (lambda: stub.Describe(pb.DescribeRequest(model=MODEL, version=2)), VersionEvicted, "version 2 is no longer"),
        (lambda: list(stub.Fetch(pb.FetchRequest(model=MODEL, version=3))), VersionNotFound, "version 3 was deleted"),
        (lambda: stub.DeleteVersion(pb.DeleteVersionRequest(model=MODEL, version=3)), VersionNotFound, "deleted"),
        (
            lambda: list(stub.Fetch(pb.FetchRequest(model=MODEL, newer_than=50))),
            CursorOutOfRange,
            "version 50 is ahead of the latest version 4",
        ),
    ]
    codes = {
        ModelNotFound: grpc.StatusCode.NOT_FOUND,
        VersionNotFound: grpc.StatusCode.NOT_FOUND,
        VersionEvicted: grpc.StatusCode.NOT_FOUND,
        CursorOutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    }
    with fetching(srv.address, {4: good_file(4)}):
        for _ in range(10):
            for call, exc_type, *fragments in cases:
                with raw_raises(exc_type, codes[exc_type], *fragments):
                    call()
    assert [v.version for v in client.list_versions(MODEL)] == [4]


# ---------------------------------------------------------------------- watch cursors
def test_bogus_watch_cursors(server, client, other_client, stub, good) -> None:
    live = other_client.watch(MODEL, since=2, timeout=WAIT * 3)
    received: list[object] = []

    def watch() -> None:
        try:
            received.append(next(live).version)
        except Exception as exc:
            received.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    far = 2**64 - 1
    with fetching(server.address, {2: good[2]}):
        with raw_raises(
            CursorOutOfRange, grpc.StatusCode.OUT_OF_RANGE, f"since={far} is ahead of the latest version 2", "since=0"
        ):
            next(stub.Watch(pb.WatchRequest(model=MODEL, since=far), timeout=WAIT))
        with raises_rpc(CursorOutOfRange, grpc.StatusCode.OUT_OF_RANGE, "since=3", "latest version 2", "since=0"):
            next(iter(client.watch(MODEL, since=3, timeout=WAIT)))
        # A model that has no version yet: a cursor above 0 cannot be resumed either.
        with raises_rpc(CursorOutOfRange, grpc.StatusCode.OUT_OF_RANGE, "'ghost'", "since=5", "latest version 0"):
            next(iter(client.watch("ghost", since=5, timeout=WAIT)))
    # The other client's watch was never disturbed: it gets the next version.
    assert client.publish_bytes(MODEL, good_file(3)).version == 3
    watcher.join(WAIT)
    assert not watcher.is_alive(), "the other client's watch got nothing after the bogus cursors"
    live.close()
    assert received == [3]

    # The cursor is a uint64: a negative one is refused by the client at the call, naming the
    # argument, the way fetch(newer_than=-1) is (test_version_arguments.py: every such argument).
    with pytest.raises(InvalidRequest, match=r"since.*-1"):
        client.watch(MODEL, since=-1, timeout=WAIT)


# ---------------------------------------------------------------------- racing publishers
def racing_file(round_: int, pid: int) -> bytes:
    """Publisher 0 and 1 send different layouts and sizes (~200-260 KiB), distinct every round."""
    value = round_ * 10 + pid
    if pid == 0:
        return st_file(
            [
                ("a", "F32", (48 * 1024,), struct.pack("<f", value) * 48 * 1024),
                ("b", "I64", (1,), struct.pack("<q", value)),
            ]
        )
    return st_file(
        [
            ("b", "I64", (32 * 1024,), struct.pack("<q", value) * 32 * 1024),
            ("a", "U8", (3,), bytes([value % 256] * 3)),
        ]
    )


@pytest.mark.parametrize("mode", ["auto_versions", "same_version", "explicit_versus_auto"])
def test_racing_publishers_never_share_or_mix_a_version(make_server, mode: str) -> None:
    """Two clients publish to one model at once, round after round, while a third fetches the
    latest version in a loop: both succeed with distinct versions, or one gets
    FAILED_PRECONDITION; every version anyone fetches is exactly one publisher's bytes, the
    bytes of the publisher whose call returned that version."""
    rounds = 12
    srv = make_server(keep=1000)
    payloads = {(r, pid): racing_file(r, pid) for r in range(rounds) for pid in (0, 1)}
    payloads[(-1, 0)] = good_file(0)
    by_digest = {sha(data): key for key, data in payloads.items()}
    fetched_digests: dict[int, set[str]] = defaultdict(set)

    def check(fetched: FetchedBytes) -> str | None:
        digest = sha(fetched.data)
        if digest not in by_digest:
            return f"v{fetched.info.version}: bytes ({digest}) are no publisher's payload"
        fetched_digests[fetched.info.version].add(digest)
        return None

    committed: dict[int, str] = {}  # version -> digest of the publisher whose call returned it
    publishers = [WeightServiceClient(srv.address, chunk_bytes=64 * 1024) for _ in range(2)]
    try:
        assert publishers[0].publish_bytes(MODEL, payloads[(-1, 0)]).version == 1
        committed[1] = sha(payloads[(-1, 0)])
        with fetching(srv.address, check=check) as fetcher:
            for r in range(rounds):
                high = max(committed)
                requested = {
                    "auto_versions": (0, 0),
                    "same_version": (high + 1, high + 1),
                    "explicit_versus_auto": (high + 1, 0),
                }[mode]
                barrier = threading.Barrier(2, timeout=WAIT)
                outcome: dict[int, object] = {}

                def publish(pid: int, r: int = r, requested=requested, barrier=barrier, outcome=outcome) -> None:
                    barrier.wait()
                    try:
                        info = publishers[pid].publish_bytes(
                            MODEL, payloads[(r, pid)], version=requested[pid], timeout=WAIT
                        )
                        outcome[pid] = info
                    except Exception as error:
                        outcome[pid] = error

                threads = [threading.Thread(target=publish, args=(pid,)) for pid in (0, 1)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(WAIT * 3)
                assert len(outcome) == 2, f"round {r}: a publisher hung"

                won = {pid: info for pid, info in outcome.items() if not isinstance(info, Exception)}
                lost = {pid: exc for pid, exc in outcome.items() if isinstance(exc, Exception)}
                for pid, exc in lost.items():
                    assert isinstance(exc, VersionConflict), f"round {r}: publisher {pid} got {exc!r}"
                    assert isinstance(exc.__context__, grpc.RpcError)
                    assert exc.__context__.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert f"requested version {requested[pid]} is not greater than the latest version" in str(exc)
                    assert requested[pid] != 0, "a publish without a version number lost the race"
                assert len(won) >= 1 and len({info.version for info in won.values()}) == len(won)
                if mode == "auto_versions":
                    assert sorted(info.version for info in won.values()) == [high + 1, high + 2]
                elif mode == "same_version":
                    assert len(won) == 1 and next(iter(won.values())).version == high + 1
                for pid, info in won.items():
                    # Its sha256 may still be being computed (the client declares only an xxh3).
                    assert info.xxh3 == xxhash.xxh3_128_hexdigest(payloads[(r, pid)])
                    committed[info.version] = sha(payloads[(r, pid)])
                fetcher.wait_for(1)
    finally:
        for publisher in publishers:
            publisher.close()

    assert len(fetched_digests) > 1, "the fetcher never saw a version published during the race"
    for version, digests in fetched_digests.items():
        assert digests == {committed[version]}, f"v{version}: fetched {digests}, committed {committed[version]}"
    with WeightServiceClient(srv.address) as reader:
        wait_until(lambda: all(v.sha256 for v in reader.list_versions(MODEL)), WAIT)
        listed = {v.version: v.sha256 for v in reader.list_versions(MODEL)}
        assert listed == committed
        for version, digest in committed.items():
            fetched = reader.fetch_bytes(MODEL, version=version, transport="stream")
            assert fetched is not None and sha(fetched.data) == digest


# ---------------------------------------------------------------------- deadlines
def assert_deadline_exceeded(info: pytest.ExceptionInfo) -> None:
    error = info.value
    assert type(error) is DeadlineExceeded, f"expected DeadlineExceeded, got {type(error).__name__}: {error}"
    assert isinstance(error.__context__, grpc.RpcError)
    assert error.__context__.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "Deadline Exceeded" in str(error)


def test_fetch_and_watch_deadlines(server, client, good) -> None:
    big = st_file([("w", "U8", (32 * BIG,), os.urandom(32 * BIG))])  # 32 MiB cannot stream in 1 ms
    assert client.publish_bytes("big", big).version == 1
    with fetching(server.address, {2: good[2]}):
        for _ in range(5):
            with pytest.raises(DeadlineExceeded) as info:
                client.fetch_bytes("big", transport="stream", timeout=0.001)
            assert_deadline_exceeded(info)
        events = client.watch(MODEL, since=2, timeout=0.3)  # nothing newer comes
        with pytest.raises(DeadlineExceeded) as info:
            next(iter(events))
        assert_deadline_exceeded(info)
    # The same client, and the server, carry on.
    fetched = client.fetch_bytes("big", transport="stream", timeout=WAIT)
    assert fetched is not None and bytes(fetched.data) == big


def test_publish_deadline_commits_nothing(server, client, good) -> None:
    data = st_file([("w", "U8", (8 * BIG,), os.urandom(8 * BIG))])  # 8 MiB cannot upload in 1 ms
    with fetching(server.address, {2: good[2]}):
        for _ in range(3):
            with pytest.raises(DeadlineExceeded) as info:
                client.publish_bytes(MODEL, data, timeout=0.001, transport="stream")
            assert_deadline_exceeded(info)
        for transport in ("shm", "bulk"):  # the deadline runs out in the transfer, before the Publish call
            with pytest.raises(DeadlineExceeded):
                client.publish_bytes(MODEL, data, timeout=0.001, transport=transport)
        time.sleep(0.2)  # anything the server still had in flight has ended
    assert_unchanged(client, good)


# ---------------------------------------------------------------------- damaged --data-dir
def store_payload(n: int) -> bytes:
    return st_file([("w", "U32", (2,), struct.pack("<I", n) * 2), ("b", "U8", (3,), b"abc")])


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors_about(self, fragment: str) -> bool:
        return any(r.levelno >= logging.ERROR and fragment in r.getMessage() for r in self.records)


@contextlib.contextmanager
def store_logs() -> Iterator[_Captured]:
    handler = _Captured()
    logger = logging.getLogger(STORE_LOGGER)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A data dir with versions 1-3 of MODEL (metadata step=10*n), written by the store."""
    root = tmp_path_factory.mktemp("pristine")
    store = VersionStore(root, keep=10)
    for n in (1, 2, 3):
        store.publish(MODEL, store_payload(n), metadata={"step": str(10 * n)})
    return root


# Data dirs of the property tests live in memory where there is a /dev/shm: the store fsyncs.
_TMP = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _copy(pristine: Path) -> tuple[tempfile.TemporaryDirectory, Path]:
    holder = tempfile.TemporaryDirectory(dir=_TMP)
    target = Path(holder.name) / "data"
    shutil.copytree(pristine, target)
    return holder, target


MANIFEST_2 = f"{MODEL}/000000000002.json"
DATA_2 = f"{MODEL}/000000000002.safetensors"


def assert_damaged_dir_served(root: Path, damaged_data: bool = True) -> VersionStore:
    """Load `root` (version 2 of MODEL damaged) and check the store's promise: it starts, loads
    versions 1 and 3 intact, and version 2 is either skipped with an error logged or loaded as
    exactly version 2 with the bytes on disk, in a form the server can describe."""
    on_disk = (root / DATA_2).read_bytes() if (root / DATA_2).is_file() else None
    with store_logs() as logs:
        store = VersionStore(root, keep=10)  # a damaged version must never stop the server starting
    loaded = {v.version: v for v in store.versions(MODEL)}
    assert set(loaded) <= {1, 2, 3}, f"versions {sorted(loaded)} loaded from a dir holding 1-3"
    for n in (1, 3):
        assert n in loaded, f"intact version {n} was not loaded"
        assert bytes(loaded[n].data) == store_payload(n), f"version {n} serves another version's bytes"
        assert loaded[n].metadata == {"step": str(10 * n)}
    for record in loaded.values():
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in record.metadata.items())
        assert isinstance(record.created, float) and math.isfinite(record.created)
        assert all(isinstance(g, str) for g in record.group)
        version_message(record).SerializeToString()  # what Describe, ListVersions and Watch send
    if 2 in loaded:
        record = loaded[2]
        assert on_disk is not None and bytes(record.data) == on_disk
        assert record.sha256 == sha(on_disk)
        assert parse_header(on_disk) == record.header
        if not damaged_data:
            assert on_disk == store_payload(2)
    else:
        assert logs.errors_about("000000000002") or logs.errors_about(f"{MODEL} v2"), "skipped v2 without a log"
    # Version numbers are never handed out twice, damaged or not.
    with pytest.raises(VersionConflict):
        store.check_publish(MODEL, total_bytes=1, version=3)
    return store


# Field values a damaged (or hand-edited) manifest of version 2 may hold.
MANIFEST_FIELDS = {
    "version_of_another_version": ("version", 1),
    "version_ahead": ("version", 7),
    "version_zero": ("version", 0),
    "created_not_a_number": ("created", "yesterday"),
    "created_null": ("created", None),
    "created_infinite": ("created", float("inf")),
    "created_nan": ("created", float("nan")),
    "created_out_of_range": ("created", -1e20),
    "metadata_value_not_a_string": ("metadata", {"step": 20}),
    "metadata_a_list": ("metadata", [1]),
    "metadata_null": ("metadata", None),
    "group_a_number": ("group", 5),
    "group_of_lists": ("group", [["critic"]]),
    "byte_size_a_string": ("byte_size", "97"),
    "sha256_uppercase": ("sha256", None),  # filled in below: the right digest in upper case
}


def _set_manifest_field(root: Path, field: str, value: object) -> None:
    path = root / MANIFEST_2
    manifest = json.loads(path.read_text())
    if field == "sha256" and value is None:
        value = manifest["sha256"].upper()
    manifest[field] = value
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", list(MANIFEST_FIELDS))
def test_reload_with_a_damaged_manifest_field(pristine: Path, case: str) -> None:
    field, value = MANIFEST_FIELDS[case]
    holder, root = _copy(pristine)
    with holder:
        _set_manifest_field(root, field, value)
        store = assert_damaged_dir_served(root, damaged_data=False)
        assert store.publish(MODEL, store_payload(4)).version == 4


@pytest.mark.parametrize(
    "case", ["version_of_another_version", "created_not_a_number", "metadata_value_not_a_string", "group_of_lists"]
)
def test_server_on_a_damaged_data_dir_serves_the_rest(pristine: Path, make_server, case: str) -> None:
    """The same damage, through a real server: it starts, and another client lists, fetches
    and watches the intact versions with their exact bytes."""
    field, value = MANIFEST_FIELDS[case]
    holder, root = _copy(pristine)
    with holder:
        _set_manifest_field(root, field, value)
        srv = make_server(data_dir=root)
        with WeightServiceClient(srv.address) as other:
            listed = [v.version for v in other.list_versions(MODEL)]
            assert 1 in listed and 3 in listed and set(listed) <= {1, 2, 3}
            for n in listed:
                fetched = other.fetch_bytes(MODEL, version=n, transport="stream")
                assert fetched is not None and bytes(fetched.data) == store_payload(n)
            latest = other.fetch_bytes(MODEL)
            assert latest is not None and latest.info.version == 3 and bytes(latest.data) == store_payload(3)
            events = other.watch(MODEL, since=0, timeout=WAIT)
            try:
                assert [next(events).version for _ in listed] == listed
            finally:
                events.close()


# -- property: random damage
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
_MANIFEST_KEYS = ["format", "model", "version", "byte_size", "sha256", "created", "metadata", "pinned", "group"]


@st.composite
def _damage(draw) -> tuple[str, Callable[[Path], None], bool]:
    """(description, damage(root), whether the data file changes)."""
    kind = draw(
        st.sampled_from(
            [
                "manifest_field",
                "manifest_field",
                "manifest_field",
                "manifest_drop_field",
                "manifest_whole",
                "manifest_bytes",
                "data_bytes",
                "data_replaced_with_matching_manifest",
                "high_water",
            ]
        )
    )
    if kind == "manifest_field":
        field = draw(st.sampled_from([*_MANIFEST_KEYS, "extra"]))
        value = draw(_json_values)
        return f"manifest[{field!r}] = {value!r}", lambda root: _set_manifest_field(root, field, value), False
    if kind == "manifest_drop_field":
        field = draw(st.sampled_from(_MANIFEST_KEYS))

        def drop(root: Path) -> None:
            path = root / MANIFEST_2
            manifest = json.loads(path.read_text())
            del manifest[field]
            path.write_text(json.dumps(manifest))

        return f"manifest without {field!r}", drop, False
    if kind == "manifest_whole":
        value = draw(_json_values)
        return f"manifest is {value!r}", lambda root: (root / MANIFEST_2).write_text(json.dumps(value)), False

    target = {"manifest_bytes": MANIFEST_2, "data_bytes": DATA_2, "high_water": f"{MODEL}/high_water.json"}.get(
        kind, DATA_2
    )
    if kind == "data_replaced_with_matching_manifest":
        # New bytes with a manifest that agrees (size, digest): loaded only if they parse.
        base = draw(st.sampled_from([store_payload(2), b""]))
        new = base + draw(st.binary(max_size=64)) if draw(st.booleans()) else draw(st.binary(max_size=200))

        def replace(root: Path) -> None:
            (root / DATA_2).write_bytes(new)
            path = root / MANIFEST_2
            manifest = json.loads(path.read_text())
            manifest.update(byte_size=len(new), sha256=sha(new))
            path.write_text(json.dumps(manifest))

        return f"data replaced by {new!r} with a matching manifest", replace, True

    op = draw(st.sampled_from(["truncate", "flip", "insert", "replace", "append"]))
    where = draw(st.integers(min_value=0))
    byte = draw(st.integers(1, 255))
    junk = draw(st.binary(max_size=64))
    high_water_json = draw(_json_values)

    def mutate(root: Path) -> None:
        path = root / target
        if kind == "high_water":
            path.write_text(json.dumps({"high_water": high_water_json}))
            return
        data = path.read_bytes()
        at = where % (len(data) + 1)
        if op == "truncate":
            data = data[:at]
        elif op == "flip":
            at %= len(data)
            data = data[:at] + bytes([data[at] ^ byte]) + data[at + 1 :]
        elif op == "insert":
            data = data[:at] + bytes([byte]) + data[at:]
        elif op == "replace":
            data = junk
        else:
            data += junk or b"\0"
        path.write_bytes(data)

    description = f"high_water.json holds {high_water_json!r}" if kind == "high_water" else f"{op} {target}"
    return description, mutate, kind == "data_bytes"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damage=_damage())
def test_property_damaged_version_is_skipped_and_the_rest_served(pristine: Path, damage) -> None:
    _, apply, changes_data = damage
    holder, root = _copy(pristine)
    with holder:
        apply(root)
        store = assert_damaged_dir_served(root, damaged_data=changes_data)
        assert store.publish(MODEL, store_payload(4)).version >= 4


# -- property: valid data dirs always load
_model_names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,15}", fullmatch=True).filter(lambda s: ".." not in s)
_tensor_specs = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=6).filter(lambda s: s != "__metadata__"),
        st.sampled_from(sorted(DTYPE_SIZES)),
        st.lists(st.integers(0, 3), max_size=2).map(tuple),
    ),
    max_size=4,
    unique_by=lambda t: t[0],
)


@st.composite
def _versions(draw) -> list[tuple[str, bytes, dict[str, str], bool]]:
    published = []
    for _ in range(draw(st.integers(1, 5))):
        tensors = [
            (name, dtype, shape, draw(st.binary(min_size=n, max_size=n)))
            for name, dtype, shape in draw(_tensor_specs)
            for n in [math.prod(shape) * DTYPE_SIZES[dtype]]
        ]
        metadata = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))
        header_metadata = draw(st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
        published.append((draw(_model_names), st_file(tensors, header_metadata), metadata, draw(st.booleans())))
    return published


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(versions=_versions())
def test_property_valid_data_dirs_always_load(versions) -> None:
    with tempfile.TemporaryDirectory(dir=_TMP) as directory:
        store = VersionStore(directory, keep=10)
        originals = [store.publish(model, data, metadata=metadata, pin=pin) for model, data, metadata, pin in versions]
        with store_logs() as logs:
            reloaded = VersionStore(directory, keep=10)
        assert not logs.errors_about(""), [r.getMessage() for r in logs.records]
        for original in originals:
            record = reloaded.get(original.model, original.version)
            assert bytes(record.data) == bytes(original.data)
            assert (record.sha256, record.metadata, record.pinned, record.created, record.header) == (
                original.sha256,
                original.metadata,
                original.pinned,
                original.created,
                original.header,
            )
            version_message(record).SerializeToString()
        for model in {o.model for o in originals}:
            high = max(o.version for o in originals if o.model == model)
            assert reloaded.publish(model, store_payload(0)).version == high + 1
