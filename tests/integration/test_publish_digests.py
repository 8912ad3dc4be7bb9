"""The digests a publisher declares (xxh3, sha256, or both), each checked before a version is
visible, and the sha256 of an xxh3-only publish, computed after the commit: "" until then in
descriptions, always in a Fetch stream's header, kept across pins and restarts. Real servers
on loopback and real gRPC, and the store alone where a race needs holding still."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator

import grpc
import pytest
import xxhash
from waiting import wait_until

import weightserver.protocol.digests as digests_module
import weightserver.storage.hashing as hashing_module
from tests.integration.test_errors import chunks, raw_raises
from weightclient import IntegrityError, WeightServiceClient
from weightserver.protocol.errors import InvalidRequest, ServerUnavailable, VersionNotFound
from weightserver.protocol.safetensors_format import build_header
from weightserver.storage.store import VersionStore
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
WAIT = 30.0


def make_file(n: int, size: int = 4096) -> bytes:
    """A valid safetensors file of about `size` bytes, distinct for every n."""
    body = n.to_bytes(4, "little") * (size // 4)
    prefix, _ = build_header([("w", "U32", (len(body) // 4,), len(body)), ("empty", "F16", (0,), 0)])
    return prefix + body


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def publish_stream(data: bytes, *, sha256: str = "", xxh3: str = "", in_commit: str = "", chunk: int = 64 * 1024):
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), sha256=sha256, xxh3=xxh3)
    yield pb.PublishRequest(header=header)
    yield from chunks(data, chunk)
    yield pb.PublishRequest(commit=pb.PublishCommit(sha256=[in_commit] if in_commit else []))


class HashGate:
    """Holds the store's sha256 (weightserver.protocol.digests.sha256_hex) until opened: `entered` is set
    once a hash is waiting at the gate."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self._real = digests_module.sha256_hex

    def __call__(self, data) -> str:
        self.calls += 1
        self.entered.set()
        assert self.opened.wait(WAIT), "the hash gate was never opened"
        return self._real(data)


@pytest.fixture
def gate(make_server, monkeypatch) -> Iterator[HashGate]:
    """Set up after make_server, so opened before any server stops (which waits for its hash)."""
    held = HashGate()
    monkeypatch.setattr(digests_module, "sha256_hex", held)
    try:
        yield held
    finally:
        held.opened.set()


@pytest.fixture
def publisher(make_server) -> Iterator[tuple[WeightServiceClient, pb_grpc.WeightServiceStub]]:
    server = make_server()
    with WeightServiceClient(server.address) as client, grpc.insecure_channel(server.address) as channel:
        yield client, pb_grpc.WeightServiceStub(channel)


# ---------------------------------------------------------------------- the digests' format
# XXH3-128 reference vectors from xxHash's own sanity test (xxhsum's XSUM_XXH128_testdata), as
# (length, seed, (low64, high64)) over its generated buffer: written down, not computed here.
XXH3_128_VECTORS = [(0, 0, (0x6001C324468D497F, 0x99AA06D3014798D8)), (6, 0, (0x3E7039BDDA43CFC6, 0x082AFE0B8162D12A))]


def xxhsum_sanity_buffer(length: int) -> bytes:
    """The input of xxHash's sanity test vectors (XSUM_fillTestBuffer)."""
    prime32, prime64 = 2654435761, 11400714785074694797
    generator, out = prime32, bytearray()
    for _ in range(length):
        out.append(generator >> 56)
        generator = (generator * prime64) % 2**64
    return bytes(out)


def test_xxh3_digests_are_xxh3_128_seed_0_in_canonical_big_endian_order(publisher) -> None:
    """The proto's "Digests": 32 hex characters, the high 64 bits first, each half most
    significant byte first (XXH128_canonicalFromHash), as the server sends them for each tensor
    and as python-xxhash's xxh3_128_hexdigest writes them."""
    client, stub = publisher
    tensors = {f"t{length}": xxhsum_sanity_buffer(length) for length, _, _ in XXH3_128_VECTORS}
    prefix, _ = build_header([(name, "U8", (len(data),), len(data)) for name, data in tensors.items()])
    data = prefix + b"".join(tensors.values())
    client.publish_bytes(MODEL, data, sha256=sha(data))
    messages = list(stub.Fetch(pb.FetchRequest(model=MODEL), timeout=WAIT))
    described = {t.name: t.xxh3 for t in messages[0].header.tensors}
    for length, seed, (low, high) in XXH3_128_VECTORS:
        canonical = high.to_bytes(8, "big").hex() + low.to_bytes(8, "big").hex()
        assert described[f"t{length}"] == canonical
        assert xxhash.xxh3_128_hexdigest(tensors[f"t{length}"], seed=seed) == canonical
    assert described["t0"] == "99aa06d3014798d86001c324468d497f"  # the proto's worked example
    # The whole file: the same order, and a client without xxh3 checks the sha256 the Fetch
    # header carries against the chunks, which are the published file byte for byte.
    assert messages[0].header.xxh3 == f"{xxhash.xxh3_128_intdigest(data):032x}"
    assert b"".join(m.chunk for m in messages[1:]) == data
    assert hashlib.sha256(data).hexdigest() == messages[0].header.sha256


# ---------------------------------------------------------------------- sha256 after the commit
def test_an_xxh3_only_publish_commits_before_its_sha256_and_gets_it_soon(publisher, gate) -> None:
    client, _ = publisher
    data = make_file(1)
    info = client.publish_bytes(MODEL, data)  # declares only the xxh3; the sha256 is held at the gate
    assert (info.version, info.xxh3, info.sha256) == (1, xxh3(data), "")
    assert gate.entered.wait(WAIT)
    assert client.describe(MODEL, 1).sha256 == client.latest(MODEL).sha256 == ""
    assert [v.sha256 for v in client.list_versions(MODEL)] == [""]
    gate.opened.set()
    wait_until(lambda: client.describe(MODEL, 1).sha256 != "", WAIT)
    assert client.describe(MODEL, 1).sha256 == client.latest(MODEL).sha256 == sha(data)
    assert [v.sha256 for v in client.list_versions(MODEL)] == [sha(data)]


def test_the_pass_after_the_commit_runs_at_the_lowest_priority(publisher, gate) -> None:
    """Its thread runs at nice 19 (hashing.BACKGROUND_NICE): on a host with few cores it yields to the
    next publish's copy and to the followers applying the version, and still runs on an idle core."""
    client, _ = publisher
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    client.publish_bytes(MODEL, make_file(1))
    assert gate.entered.wait(WAIT)  # the pass is hashing, in its thread
    (worker,) = [t for t in threading.enumerate() if t.name.startswith("weightserver-sha256")]
    assert worker.native_id is not None and os.getpriority(os.PRIO_PROCESS, worker.native_id) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's own is untouched
    gate.opened.set()


def test_a_fetch_stream_header_carries_the_sha256_it_waited_for(publisher, gate) -> None:
    client, stub = publisher
    data = make_file(2, size=3 << 20)
    client.publish_bytes(MODEL, data)
    assert gate.entered.wait(WAIT)
    fetched: list[pb.FetchResponse] = []
    fetching = threading.Thread(target=lambda: fetched.extend(stub.Fetch(pb.FetchRequest(model=MODEL), timeout=WAIT)))
    fetching.start()
    fetching.join(0.5)
    assert fetching.is_alive(), "the fetch did not wait for the sha256"
    assert client.describe(MODEL, 1).sha256 == ""  # the server answers meanwhile: its loop is not held
    gate.opened.set()
    fetching.join(WAIT)
    header = fetched[0].header
    assert header.sha256 == sha(data) and header.xxh3 == xxh3(data)
    assert b"".join(m.chunk for m in fetched[1:]) == data
    again = client.fetch_bytes(MODEL, transport="stream")  # known by now: at once
    assert again is not None and again.info.sha256 == sha(data)


def test_a_fetch_of_a_known_sha256_does_not_wait(publisher) -> None:
    client, stub = publisher
    data = make_file(3)
    client.publish_bytes(MODEL, data, sha256=sha(data))  # declared: known at the commit
    messages = list(stub.Fetch(pb.FetchRequest(model=MODEL), timeout=WAIT))
    assert messages[0].header.sha256 == sha(data)


# ---------------------------------------------------------------------- declared digests
def test_a_wrong_xxh3_is_data_loss_and_nothing_becomes_visible(publisher) -> None:
    client, stub = publisher
    good, bad = make_file(1), make_file(2)
    client.publish_bytes(MODEL, good)
    wrong = xxh3(good)  # the digest of other bytes
    with raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, "xxh3", xxh3(bad), wrong):
        stub.Publish(publish_stream(bad, xxh3=wrong), timeout=WAIT)
    with raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, "xxh3", wrong):  # a right sha256 does not help
        stub.Publish(publish_stream(bad, xxh3=wrong, sha256=sha(bad)), timeout=WAIT)
    assert [v.version for v in client.list_versions(MODEL)] == [1]
    assert client.latest(MODEL).xxh3 == xxh3(good)


def test_a_wrong_sha256_is_data_loss_however_it_is_declared(publisher) -> None:
    client, stub = publisher
    data = make_file(1)
    wrong = sha(make_file(2))
    cases = {
        "header": {"sha256": wrong},
        "header_with_a_right_xxh3": {"sha256": wrong, "xxh3": xxh3(data)},
        "commit_with_a_right_xxh3": {"in_commit": wrong, "xxh3": xxh3(data)},
    }
    for declared in cases.values():
        with raw_raises(IntegrityError, grpc.StatusCode.DATA_LOSS, "sha256", sha(data), wrong):
            stub.Publish(publish_stream(data, **declared), timeout=WAIT)
    with pytest.raises(Exception, match="no model"):
        client.latest(MODEL)


def test_every_way_to_declare_right_digests_commits(publisher) -> None:
    client, stub = publisher
    cases = {
        "sha256": lambda d: {"sha256": sha(d)},
        "xxh3": lambda d: {"xxh3": xxh3(d)},
        "both": lambda d: {"sha256": sha(d), "xxh3": xxh3(d).upper()},
        "sha256_in_commit": lambda d: {"in_commit": sha(d), "xxh3": xxh3(d)},
    }
    for n, (name, declared) in enumerate(cases.items(), start=1):
        data = make_file(n)
        reply = stub.Publish(publish_stream(data, **declared(data)), timeout=WAIT)
        assert reply.version.version == n and reply.version.xxh3 == xxh3(data), name
        if name != "xxh3":  # known at the commit wherever a sha256 was declared
            assert reply.version.sha256 == sha(data), name
    wait_until(lambda: all(v.sha256 for v in client.list_versions(MODEL)), WAIT)


def test_a_declared_sha256_is_hashed_as_the_chunks_arrive(publisher, gate) -> None:
    """In uneven chunks over several of the server's 4 MiB batches; the store never hashes
    (its sha256 is held at the gate) and the reply carries the digest."""
    _, stub = publisher
    data = make_file(7, size=(9 << 20) + 12)
    reply = stub.Publish(publish_stream(data, sha256=sha(data), chunk=(1 << 20) - 3), timeout=WAIT)
    assert reply.version.sha256 == sha(data)
    assert gate.calls == 0


# ---------------------------------------------------------------------- data dir
def test_a_data_dir_keeps_the_sha256_of_an_xxh3_only_publish_across_a_restart(make_server, tmp_path) -> None:
    data = make_file(4)
    server = make_server(data_dir=tmp_path)
    with WeightServiceClient(server.address) as client:
        info = client.publish_bytes(MODEL, data)
    # With a data dir the sha256 is computed while the file is written: in the reply already.
    assert info.sha256 == sha(data)
    manifest = json.loads((tmp_path / MODEL / f"{1:012d}.json").read_text())
    assert manifest["sha256"] == sha(data)
    server.stop(grace=0)
    restarted = make_server(data_dir=tmp_path)
    with WeightServiceClient(restarted.address) as client:
        assert client.describe(MODEL, 1).sha256 == sha(data)
        fetched = client.fetch_bytes(MODEL, transport="stream")
        assert fetched is not None and bytes(fetched.data) == data


# ---------------------------------------------------------------------- the store alone
def test_the_direct_api_still_computes_the_sha256_at_once_unless_only_an_xxh3_is_declared(gate) -> None:
    gate.opened.set()
    store = VersionStore()
    data = make_file(1)
    assert store.publish(MODEL, data).sha256 == sha(data)
    assert store.publish(MODEL, data, xxh3=xxh3(data), sha256=sha(data)).sha256 == sha(data)
    pending = store.publish(MODEL, data, xxh3=xxh3(data))
    assert pending.sha256 == ""
    assert store.sha256_of(pending).result(WAIT) == sha(data)
    assert store.get(MODEL, pending.version).sha256 == sha(data)
    with pytest.raises(IntegrityError, match=f"xxh3 of the received bytes is {xxh3(data)}, publisher declared 00"):
        store.publish(MODEL, data, xxh3="00")
    store.close()


def test_the_sha256_waits_out_its_delay_unless_a_reader_asks(monkeypatch) -> None:
    """The moments after a commit are the followers': the background sha256 waits
    SHA256_DELAY_SECONDS, unless a reader (a Fetch stream's header) asks for it."""
    monkeypatch.setattr(hashing_module, "SHA256_DELAY_SECONDS", 3600.0)
    store = VersionStore()
    data = make_file(1)
    record = store.publish(MODEL, data, xxh3=xxh3(data))
    quiet = store.sha256_of(record, hurry=False)  # as the shm header rewrite asks: no hurry
    with pytest.raises(TimeoutError):
        quiet.result(0.3)
    assert store.get(MODEL, 1).sha256 == ""
    assert store.sha256_of(record).result(WAIT) == sha(data)  # a reader: at once
    assert quiet.result(0) == sha(data) and store.get(MODEL, 1).sha256 == sha(data)
    later = store.publish(MODEL, make_file(2), xxh3=xxh3(make_file(2)))
    with pytest.raises(TimeoutError):  # the hurry was for the one asked for, not for later ones
        store.sha256_of(later, hurry=False).result(0.3)
    store.close()  # does not wait out the delay either
    with pytest.raises(ServerUnavailable):
        store.sha256_of(later, hurry=False).result(WAIT)


def test_a_pin_while_the_sha256_is_computed_keeps_both(gate) -> None:
    store = VersionStore(keep=1)
    data = make_file(1)
    record = store.publish(MODEL, data, xxh3=xxh3(data))
    assert gate.entered.wait(WAIT)  # the worker is hashing it
    pinned = store.set_pinned(MODEL, 1, True)
    assert pinned.pinned and pinned.sha256 == ""
    gate.opened.set()
    assert store.sha256_of(record).result(WAIT) == sha(data)
    current = store.get(MODEL, 1)
    assert current.pinned and current.sha256 == sha(data)
    assert store.set_pinned(MODEL, 1, False).sha256 == sha(data)  # a later pin keeps the sha256
    store.close()


def test_a_version_evicted_before_its_turn_drops_its_job(gate) -> None:
    store = VersionStore(keep=1)
    files = [make_file(n) for n in range(3)]
    first = store.sha256_of(store.publish(MODEL, files[0], xxh3=xxh3(files[0])))
    assert gate.entered.wait(WAIT)  # the worker is busy with the first
    second = store.publish(MODEL, files[1], xxh3=xxh3(files[1]))
    waiting = store.sha256_of(second)
    assert not waiting.cancel()  # several callers may wait on it: nobody can cancel it
    third = store.publish(MODEL, files[2], xxh3=xxh3(files[2]))  # evicts the first two
    gate.opened.set()
    assert store.sha256_of(third).result(WAIT) == sha(files[2])
    assert first.result(WAIT) == sha(files[0])  # evicted while being hashed: done anyway
    with pytest.raises(VersionNotFound, match="evicted or deleted before its sha256"):
        waiting.result(WAIT)
    assert gate.calls == 2  # the second was never hashed
    store.close()


def test_a_publish_id_retry_is_told_apart_by_its_bytes_while_the_sha256_is_pending(gate) -> None:
    store = VersionStore()
    data, other = make_file(1), make_file(2)
    first = store.publish(MODEL, data, xxh3=xxh3(data), publish_id="id-1")
    assert first.sha256 == ""
    with pytest.raises(InvalidRequest, match="other bytes"):
        store.publish(MODEL, other, xxh3=xxh3(other), publish_id="id-1")
    assert store.publish(MODEL, data, xxh3=xxh3(data), publish_id="id-1").version == first.version
    gate.opened.set()
    store.close()


def test_closing_the_store_fails_the_sha256s_still_waiting(gate) -> None:
    store = VersionStore()
    data = [make_file(n) for n in range(2)]
    hashing = store.publish(MODEL, data[0], xxh3=xxh3(data[0]))
    assert gate.entered.wait(WAIT)
    queued = store.publish(MODEL, data[1], xxh3=xxh3(data[1]))
    closing = threading.Thread(target=store.close)
    closing.start()
    gate.opened.set()
    closing.join(WAIT)
    assert store.sha256_of(hashing).result(WAIT) == sha(data[0])  # the running hash finished
    with pytest.raises(ServerUnavailable):
        store.sha256_of(queued).result(WAIT)
    assert store.get(MODEL, queued.version).sha256 == ""
