"""Issue 29 items 4, 7 and 8: what one publisher can do to others, against real servers on
loopback, with raw stubs where the client would not send such input.

4. A publish id names one publish in the whole server: a second model may not reuse it while a
   retained version carries it, and an id that is not UTF-8 is the caller's error.
7. A publisher that stalls, or drips messages without bytes, gets no priority over stream
   fetches from it (commits first): a 1 MiB stream fetch stays about as fast as with the
   server idle.
8. An upload set up by one caller's Negotiate can be named only by that caller (the same
   token), and a claim that does not match leaves the owner's upload alone.
"""

from __future__ import annotations

import hashlib
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from waiting import wait_for

from tests.integration.test_errors import watch_publish_start
from tests.integration.test_fetch_turns import safetensors_file
from weightclient.core.service_client import WeightServiceClient
from weightserver.protocol.errors import ERROR_METADATA_KEY, InvalidRequest, ModelNotFound
from weightserver.storage.store import Upload, VersionStore
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

WAIT = 30.0
PUBLISH_METHOD = "/weightserver.v1.WeightService/Publish"
NEGOTIATE_METHOD = "/weightserver.v1.WeightService/Negotiate"


def _error_name(error: grpc.RpcError) -> str:
    return dict(error.trailing_metadata() or ()).get(ERROR_METADATA_KEY, "")


# ---------------------------------------------------------------------- item 4: publish ids
def test_a_publish_id_names_one_publish_across_models(make_server) -> None:
    server = make_server(shm_dir=None)
    a, b = safetensors_file(1024), safetensors_file(2048)
    with WeightServiceClient(server.address) as client:
        assert client.publish_bytes("a", a, publish_id="run-7-step-1").version == 1
        with pytest.raises(InvalidRequest) as refused:
            client.publish_bytes("b", b, publish_id="run-7-step-1")
        message = str(refused.value)
        assert "publish id 'run-7-step-1' was already used by version 1 of 'a'" in message
        assert "a new publish needs a new id" in message  # what to do
        with pytest.raises(ModelNotFound):  # nothing of b was committed
            client.latest("b")
        # Exactly once still: the same model and bytes with the same id get the first version.
        assert client.publish_bytes("a", a, publish_id="run-7-step-1").version == 1
        assert client.latest("a").version == 1


def test_a_publish_id_is_free_again_once_no_retained_version_carries_it(make_server) -> None:
    server = make_server(shm_dir=None, keep=1)
    with WeightServiceClient(server.address) as client:
        assert client.publish_bytes("a", safetensors_file(64), publish_id="once").version == 1
        assert client.publish_bytes("a", safetensors_file(64), publish_id="twice").version == 2  # evicts v1
        assert client.publish_bytes("b", safetensors_file(64), publish_id="once").version == 1


def test_a_publish_id_of_a_publish_committing_now_is_refused_to_other_models() -> None:
    store = VersionStore()
    committing, finish = threading.Event(), threading.Event()

    def commit() -> None:
        with store.commit([Upload("a", safetensors_file(64))], publish_id="x"):
            committing.set()
            finish.wait(WAIT)

    first = threading.Thread(target=commit)
    first.start()
    try:
        assert committing.wait(WAIT)
        with pytest.raises(InvalidRequest, match="belongs to a publish of 'a' committing now"):
            store.publish("b", safetensors_file(64), publish_id="x")
    finally:
        finish.set()
        first.join(WAIT)
    assert store.latest("a").publish_id == "x"
    with pytest.raises(ModelNotFound):
        store.latest("b")


def test_publish_ids_are_checked_across_models_after_a_restart_and_after_many_publishes(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, keep=1)
    store.publish("a", safetensors_file(64), publish_id="kept")
    store = VersionStore(tmp_path, keep=1)  # the ids come back from the manifests
    with pytest.raises(InvalidRequest, match="already used by version 1 of 'a'"):
        store.publish("b", safetensors_file(64), publish_id="kept")
    store = VersionStore(keep=1)  # in memory: quicker
    store.publish("a", safetensors_file(64), publish_id="kept")
    for i in range(2100):  # the index of ids is rebuilt twice on the way, forgetting evicted ones
        store.publish("c", safetensors_file(8), publish_id=f"step-{i}")
    assert store.publish("d", safetensors_file(8), publish_id="step-0").version == 1  # evicted from c: free
    with pytest.raises(InvalidRequest, match="already used by version 2100 of 'c'"):
        store.publish("d", safetensors_file(8), publish_id="step-2099")
    with pytest.raises(InvalidRequest, match="already used by version 1 of 'a'"):
        store.publish("b", safetensors_file(64), publish_id="kept")


def _raw_header_with_id(model: str, total_bytes: int, publish_id: bytes) -> bytes:
    """A serialized PublishHeader whose publish_id is `publish_id` as given (not UTF-8 here)."""
    placeholder = "P" * len(publish_id)
    raw = pb.PublishHeader(model=model, total_bytes=total_bytes, publish_id=placeholder).SerializeToString()
    return raw.replace(placeholder.encode(), publish_id)


def test_a_publish_id_that_is_not_utf8_is_invalid_argument(make_server) -> None:
    server = make_server(shm_dir=None)
    header = _raw_header_with_id("a", 64, b"\xff\xfe-id")
    publish_request = b"\x0a" + bytes([len(header)]) + header  # PublishRequest.header (field 1)
    negotiate_request = pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH).SerializeToString()
    negotiate_request += b"\x22" + bytes([len(header)]) + header  # NegotiateRequest.publish (field 4)
    assert pb.NegotiateRequest.DESCRIPTOR.fields_by_name["publish"].number == 4
    with grpc.insecure_channel(server.address) as channel:
        publish = channel.stream_unary(PUBLISH_METHOD, request_serializer=bytes, response_deserializer=bytes)
        negotiate = channel.unary_unary(NEGOTIATE_METHOD, request_serializer=bytes, response_deserializer=bytes)
        for call in (lambda: publish(iter([publish_request]), timeout=WAIT), lambda: negotiate(negotiate_request)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert _error_name(refused.value) == "InvalidRequest"
            assert "must be valid UTF-8" in refused.value.details()
    with WeightServiceClient(server.address) as client, pytest.raises(ModelNotFound):
        client.latest("a")


# ---------------------------------------------------------------------- item 8: upload ids
TOKENS = {
    "owner": ("publisher:policy", "o" * 24),
    "other": ("publisher:value", "v" * 24),
    "any": ("publisher", "y" * 24),
}


def _metadata(name: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name][1]}"),) if name else ()


def _staged_upload(stub: pb_grpc.WeightServiceStub, model: str, data: bytes, token: str | None) -> str:
    """Set up a shared-memory upload of `data` for `model` as `token`'s caller and write it: its id."""
    header = pb.PublishHeader(model=model, total_bytes=len(data))
    request = pb.NegotiateRequest(direction=pb.DIRECTION_PUBLISH, accept=[pb.TRANSPORT_SHARED_MEMORY], publish=header)
    answer = stub.Negotiate(request, timeout=WAIT, metadata=_metadata(token))
    assert answer.transport == pb.TRANSPORT_SHARED_MEMORY and answer.upload
    with open(answer.payload.shared_memory.path, "r+b") as file:
        file.write(data)
    return answer.upload


def _publish_upload(
    stub: pb_grpc.WeightServiceStub, model: str, total_bytes: int, upload: str, sha256: str, token: str | None
) -> pb.PublishResponse:
    requests = [
        pb.PublishRequest(header=pb.PublishHeader(model=model, total_bytes=total_bytes, sha256=sha256)),
        pb.PublishRequest(uploaded=pb.PublishUploaded(upload=upload)),
        pb.PublishRequest(commit=pb.PublishCommit()),
    ]
    return stub.Publish(iter(requests), timeout=WAIT, metadata=_metadata(token))


@pytest.fixture
def token_server(make_server, tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text("".join(f"{role} {name} {token}\n" for name, (role, token) in TOKENS.items()))
    return make_server(auth_tokens=path, shm_dir="auto")


def test_an_upload_id_is_usable_only_by_the_token_that_set_it_up(token_server) -> None:
    data = safetensors_file(64 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    with grpc.insecure_channel(token_server.address) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        upload = _staged_upload(stub, "policy", data, "owner")
        # Another scoped publisher names it under its own model and another size...
        with pytest.raises(grpc.RpcError) as refused:
            _publish_upload(stub, "value", 1, upload, digest, "other")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
        assert "set up by another token's Negotiate" in refused.value.details()
        # ... and a publisher of every model with exactly the owner's header: both refused.
        with pytest.raises(grpc.RpcError) as refused:
            _publish_upload(stub, "policy", len(data), upload, digest, "any")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
        # The owner's upload was left alone: it commits.
        reply = _publish_upload(stub, "policy", len(data), upload, digest, "owner")
        assert reply.version.version == 1 and reply.version.sha256 == digest
        with WeightServiceClient(token_server.address, token=TOKENS["owner"][1]) as client:
            assert bytes(client.fetch_bytes("policy", transport="stream").data) == data


def test_a_mismatched_claim_without_tokens_leaves_the_upload_to_its_owner(make_server) -> None:
    server = make_server(shm_dir="auto")
    data = safetensors_file(64 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        upload = _staged_upload(stub, "policy", data, None)
        refusals = []
        for model, size in (("value", len(data)), ("policy", len(data) - 1)):
            with pytest.raises(grpc.RpcError) as refused:
                _publish_upload(stub, model, size, upload, digest, None)
            refusals.append(refused.value)
        # The owner's upload was left alone: it commits.
        assert _publish_upload(stub, "policy", len(data), upload, digest, None).version.version == 1
    for refused in refusals:
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        assert "the upload is left as it was" in refused.details()


# ---------------------------------------------------------------------- item 7: commits first
FETCHES = 30
PAUSE = (0.02, 0.12)  # seconds between one fetch's end and the next's start, drawn at random
LATENCY_BOUND = 0.3  # seconds: the p50 of a 1 MiB stream fetch during the publisher's misdeed


@pytest.fixture
def fetch_server(make_server) -> Iterator[tuple[object, bytes]]:
    """A server holding version 1 of "fetched", 1 MiB, fetched over the stream below."""
    server = make_server(shm_dir="auto")
    data = safetensors_file(1 << 20)
    with WeightServiceClient(server.address) as client:
        client.publish_bytes("fetched", data, transport="stream")
    yield server, data


def _p50_fetch(address: str, data: bytes) -> float:
    """The median time of FETCHES stream fetches, each after a random pause: back to back (or
    on a fixed beat), fast fetches would fall into the gaps between a dripping publisher's
    holds, as they end there; paused at random, they sample its holds as they come."""
    times, pauses = [], random.Random(29)
    with WeightServiceClient(address) as client:
        for _ in range(FETCHES):
            time.sleep(pauses.uniform(*PAUSE))
            started = time.monotonic()
            fetched = client.fetch_bytes("fetched", version=1, transport="stream", timeout=WAIT)
            times.append(time.monotonic() - started)
            assert bytes(fetched.data) == data
    return statistics.median(times)


class _Publisher:
    """A raw Publish call fed from a queue (None ends it), in its own channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.WeightServiceStub(self.channel)
        self.messages: queue.Queue = queue.Queue()
        self.call = self.stub.Publish.future(iter(self.messages.get, None), timeout=WAIT * 4)

    def close(self) -> None:
        self.call.cancel()
        self.messages.put(None)
        self.channel.close()


def _stall(address: str, stop: threading.Event) -> Callable[[], None]:
    """Header and `uploaded` of a staged upload, then nothing until the test ends."""
    publisher = _Publisher(address)
    data = safetensors_file(1 << 20)
    upload = _staged_upload(publisher.stub, "staller", data, None)
    publisher.messages.put(pb.PublishRequest(header=pb.PublishHeader(model="staller", total_bytes=len(data))))
    publisher.messages.put(pb.PublishRequest(uploaded=pb.PublishUploaded(upload=upload)))
    return publisher.close


def _drip(address: str, stop: threading.Event) -> Callable[[], None]:
    """A new header without bytes every 0.3 s, in one publish."""
    publisher = _Publisher(address)

    def run() -> None:
        for i in range(1000):
            publisher.messages.put(pb.PublishRequest(header=pb.PublishHeader(model=f"drip-{i}", total_bytes=0)))
            if stop.wait(0.3):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def close() -> None:
        thread.join(WAIT)
        publisher.close()

    return close


def _reopen(address: str, stop: threading.Event) -> Callable[[], None]:
    """A new publish every 0.3 s that sends a header and stalls, all of them left open."""
    publishers: list[_Publisher] = []

    def run() -> None:
        while not stop.is_set() and len(publishers) < 200:
            publisher = _Publisher(address)
            publishers.append(publisher)
            publisher.messages.put(pb.PublishRequest(header=pb.PublishHeader(model="reopened", total_bytes=64)))
            stop.wait(0.3)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def close() -> None:
        thread.join(WAIT)
        for publisher in publishers:
            publisher.close()

    return close


@pytest.mark.parametrize("misdeed", [_stall, _drip, _reopen], ids=["stall", "drip", "reopen"])
def test_a_stalling_or_dripping_publisher_does_not_slow_stream_fetches(fetch_server, misdeed) -> None:
    server, data = fetch_server
    idle = _p50_fetch(server.address, data)
    started = watch_publish_start(server)
    stop = threading.Event()
    close = misdeed(server.address, stop)
    try:
        wait_for(started.is_set, what="the publisher's first header at the server")
        during = _p50_fetch(server.address, data)
    finally:
        stop.set()
        close()
    print(
        f"1 MiB stream fetch p50: idle {idle * 1e3:.1f} ms, during the publisher's {misdeed.__name__} "
        f"{during * 1e3:.1f} ms"
    )
    assert during < LATENCY_BOUND and during < 2 * idle + 0.03, (
        f"p50 of a 1 MiB stream fetch: {during * 1e3:.0f} ms while a publisher {misdeed.__name__}s, "
        f"{idle * 1e3:.0f} ms idle"
    )
