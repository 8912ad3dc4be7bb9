"""Cut-through (issue 15): a watcher that asks hears of a publish as its first bytes land,
receives them while they arrive, and applies them only once the commit names them and they
match. Every way a publish can stop half-way is caused here, over bulk and the stream: none
ever reaches a policy."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
import xxhash

from tests.integration.test_publish_transports import BULK, file_of, negotiate_publish, publish_uploaded
from tests.waiting import wait_equal, wait_until
from weightclient import WeightClient
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater
from weightserver.protocol import framing
from weightserver.protocol.errors import PublishAborted, UploadNotFound
from weightserver.protocol.version_info import IncomingEvent, VersionEvent
from weightserver.v1 import weights_pb2 as pb

MODEL = "policy"
SIZE = 4 << 20  # float32 elements: a 16 MiB file, many chunks


def weights_filled(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((SIZE,), value), "b": torch.arange(5, dtype=torch.int64)}


class Watcher:
    """A Watch with incoming=True in a thread: every event, in order, on a queue."""

    def __init__(self, client: WeightClient, since: int = 0) -> None:
        self.events: queue.Queue[VersionEvent | IncomingEvent] = queue.Queue()
        self._stream = client.watch(MODEL, since=since, incoming=True, timeout=60)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                self.events.put(event)
        except Exception:  # closed at the end of the test
            pass

    def next(self, timeout: float = 20.0) -> VersionEvent | IncomingEvent:
        return self.events.get(timeout=timeout)

    @classmethod
    def subscribed(cls, client: WeightClient, held: int) -> Watcher:
        """A watcher whose Watch call is subscribed when this returns, so that it cannot miss
        a publish that starts next: it opens from `held - 1` and takes the event of `held`,
        which the server sends from its backlog once it has subscribed the call."""
        watcher = cls(client, since=held - 1)
        event = watcher.next()
        assert isinstance(event, VersionEvent) and event.version == held, event
        return watcher


@pytest.fixture
def watcher(server, other_client) -> Iterator[Watcher]:
    other_client.publish(weights_filled(0.0), model=MODEL, transport="stream")  # the model exists
    watching = Watcher.subscribed(other_client, held=1)
    yield watching  # its stream ends when other_client is closed


class EarlyReceive:
    """`fetch_incoming` in a thread, counting the bytes as they come."""

    def __init__(self, client: WeightClient, announced: IncomingEvent, transport: str) -> None:
        self.received = 0
        self.result: object = None
        self._thread = threading.Thread(target=self._run, args=(client, announced, transport), daemon=True)
        self._thread.start()

    def _run(self, client: WeightClient, announced: IncomingEvent, transport: str) -> None:
        def progress(done: int, total: int) -> None:
            self.received = done

        try:
            self.result = client.fetch_incoming(announced, transport=transport, timeout=30, progress=progress)
        except Exception as exc:
            self.result = exc

    def join(self) -> object:
        self._thread.join(30)
        assert not self._thread.is_alive()
        return self.result


class HeldPublish:
    """A publish of `data` over "bulk" or "stream" that sends half its bytes, then waits for
    `finish()` (the rest, then the commit) or `cut()` (the connection or call dropped). A
    shared-memory publish is not announced before its commit (see
    test_a_same_host_publish_is_not_announced_before_its_commit). `credentials` and `token`: for
    a server with TLS and tokens (over "stream" only)."""

    def __init__(
        self,
        address: str,
        data: bytes,
        over: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
    ) -> None:
        assert over == "stream" or (credentials is None and token is None), "TLS and tokens: over the stream"
        self.address, self.data, self.over = address, data, over
        self.credentials = credentials
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.xxh3 = xxhash.xxh3_128_hexdigest(data)
        self.version: int | None = None
        self.error: BaseException | None = None
        self._go = threading.Event()
        self._finish = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def finish(self) -> int | None:
        self._finish = True
        return self._end()

    def cut(self) -> None:
        self._end()

    def _end(self) -> int | None:
        self._go.set()
        self._thread.join(30)
        assert not self._thread.is_alive()
        return self.version

    def _run(self) -> None:
        try:
            {"bulk": self._bulk, "stream": self._stream}[self.over]()
        except BaseException as exc:
            self.error = exc

    def _bulk(self) -> None:
        data, half = self.data, len(self.data) // 2
        header = pb.PublishHeader(model=MODEL, total_bytes=len(data), xxh3=self.xxh3)
        answer = negotiate_publish(self.address, [BULK], header)
        with socket.create_connection(("127.0.0.1", answer.payload.bulk.port), timeout=10) as conn:
            conn.sendall(answer.payload.bulk.ticket + data[:half])
            self._go.wait(30)
            if not self._finish:
                return  # closed half-way
            conn.sendall(data[half:])
            conn.settimeout(10)
            assert conn.recv(1) == b"\x01"
        self.version = publish_uploaded(self.address, header, answer.upload).version.version

    def _stream(self) -> None:
        header = pb.PublishHeader(model=MODEL, total_bytes=len(self.data), xxh3=self.xxh3)
        chunks = list(framing.chunk_messages(self.data, 1 << 20, framing.PUBLISH_CHUNK_TAG))

        def messages() -> Iterator[object]:
            yield pb.PublishRequest(header=header)
            yield from chunks[: len(chunks) // 2]
            self._go.wait(30)
            if not self._finish:
                raise RuntimeError("the trainer crashed")  # grpc cancels the call
            yield from chunks[len(chunks) // 2 :]
            yield pb.PublishRequest(commit=pb.PublishCommit())

        self._call(messages())

    def _call(self, messages: Iterator[object]) -> None:
        if self.credentials is not None:
            channel = grpc.secure_channel(self.address, self.credentials)
        else:
            channel = grpc.insecure_channel(self.address)
        with channel:
            call = channel.stream_unary(
                "/weightserver.v1.WeightService/Publish",
                request_serializer=framing.serialize,
                response_deserializer=pb.PublishResponse.FromString,
            )
            self.version = call(messages, timeout=30, metadata=self.metadata).version.version


# ---------------------------------------------------------------------- the happy paths
@pytest.mark.parametrize("publish_over", ["bulk", "stream"])
@pytest.mark.parametrize("receive_over", ["bulk", "stream"])
def test_incoming_bytes_received_early_are_the_committed_version(
    server, other_client, watcher, publish_over, receive_over, caplog
):
    caplog.set_level(logging.INFO, logger="weightserver.service.servicer")
    data = file_of(weights_filled(1.5))
    publish = HeldPublish(server.address, data, publish_over)
    announced = watcher.next()
    assert isinstance(announced, IncomingEvent) and not announced.failed and announced.byte_size == len(data)
    receive = EarlyReceive(other_client, announced, receive_over)
    wait_until(lambda: receive.received >= 1 << 20, timeout=10, step=0.01)  # under way before the commit
    assert receive.received < len(data)
    version = publish.finish()
    committed = watcher.next()
    assert isinstance(committed, VersionEvent) and committed.version == version
    assert committed.incoming == announced.id  # the commit names the bytes announced
    early = receive.join()
    assert not isinstance(early, Exception), early
    assert early.stats.incoming and early.stats.transport == receive_over
    assert bytes(early.data) == data and committed.info.xxh3 == publish.xxh3
    # The server's one record of a cut-through transfer, whatever carried it (a relay tree's egress).
    assert f"fetch_incoming model={MODEL} bytes={len(data)} transport={receive_over}" in caplog.text


def test_a_same_host_publish_is_not_announced_before_its_commit(server, client, other_client, watcher):
    """A shared-memory publish's bytes can change until the server seals them at `uploaded`, and
    the server reads none before: watchers hear of it only at its commit, which names no
    incoming bytes, and fetch the version as usual."""
    weights = weights_filled(2.5)
    version = client.publish(weights, model=MODEL, transport="shm")
    committed = watcher.next()
    assert isinstance(committed, VersionEvent) and committed.version == version and committed.incoming == ""
    fetched = other_client.fetch(MODEL, version=version, transport="stream").state_dict()
    assert torch.equal(fetched["w"], weights["w"]) and torch.equal(fetched["b"], weights["b"])


def test_a_watch_that_does_not_ask_sees_only_commits(server, client, other_client):
    client.publish(weights_filled(0.0), model=MODEL, transport="stream")
    events = []
    stream = other_client.watch(MODEL, since=0, timeout=60)
    assert next(stream).version == 1  # from the backlog: the call is subscribed
    reader = threading.Thread(target=lambda: events.extend([next(stream)]), daemon=True)
    reader.start()
    version = client.publish(weights_filled(2.0), model=MODEL, transport="bulk")
    reader.join(20)
    stream.close()
    assert len(events) == 1 and isinstance(events[0], VersionEvent)
    assert events[0].version == version and events[0].incoming == ""


def test_incoming_bytes_are_not_found_once_their_publish_ended(server, client, watcher):
    version = client.publish(weights_filled(3.0), model=MODEL, transport="bulk")
    announced = watcher.next()
    assert isinstance(announced, IncomingEvent)
    committed = watcher.next()
    assert committed.version == version and committed.incoming == announced.id
    with pytest.raises(UploadNotFound, match="fetch the committed version"):
        client.fetch_incoming(announced, transport="stream", timeout=10)
    with pytest.raises(UploadNotFound):
        client.fetch_incoming(announced, transport="bulk", timeout=10)


# ---------------------------------------------------------------------- publishes that fail half-way
@pytest.mark.parametrize("publish_over", ["bulk", "stream"])
@pytest.mark.parametrize("receive_over", ["bulk", "stream"])
def test_a_publish_cut_half_way_aborts_the_early_receive(server, other_client, watcher, publish_over, receive_over):
    data = file_of(weights_filled(4.0))
    publish = HeldPublish(server.address, data, publish_over)
    announced = watcher.next()
    assert isinstance(announced, IncomingEvent) and not announced.failed
    receive = EarlyReceive(other_client, announced, receive_over)
    wait_until(lambda: receive.received >= 1 << 20, timeout=10, step=0.01)  # bytes flowing before the cut
    publish.cut()  # the upload's connection, or the Publish call, dropped half-way
    failed = watcher.next()
    assert isinstance(failed, IncomingEvent) and failed.id == announced.id and failed.failed
    assert isinstance(receive.join(), PublishAborted)
    assert receive.received < len(data)
    assert other_client.latest(MODEL).version == 1


def test_a_publish_whose_digest_fails_is_announced_failed(server, client, watcher):
    with pytest.raises(RuntimeError, match="xxh3"):
        _publish_wrong_xxh3(server.address, file_of(weights_filled(6.0)))
    announced, failed = watcher.next(), watcher.next()
    assert isinstance(announced, IncomingEvent) and isinstance(failed, IncomingEvent)
    assert failed.id == announced.id and failed.failed
    assert client.latest(MODEL).version == 1


def _publish_wrong_xxh3(address: str, data: bytes) -> None:
    """A stream publish whose declared xxh3 is not its bytes' (DATA_LOSS)."""
    header = pb.PublishHeader(model=MODEL, total_bytes=len(data), xxh3="0" * 32)
    messages = [pb.PublishRequest(header=header), *framing.chunk_messages(data, 1 << 20, framing.PUBLISH_CHUNK_TAG)]
    messages.append(pb.PublishRequest(commit=pb.PublishCommit()))
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary(
            "/weightserver.v1.WeightService/Publish",
            request_serializer=framing.serialize,
            response_deserializer=pb.PublishResponse.FromString,
        )
        try:
            call(iter(messages), timeout=30)
        except grpc.RpcError as exc:
            raise RuntimeError(exc.details()) from None


# ---------------------------------------------------------------------- the updater
@pytest.fixture
def make_updater() -> Iterator:
    """Watching updaters with clients of their own, stopped and closed after the test."""
    made: list[GrpcLocalWeightUpdater] = []

    def make(address: str, policy: torch.nn.Module, transport: str) -> GrpcLocalWeightUpdater:
        made.append(GrpcLocalWeightUpdater(address, model=MODEL, policy=policy, watch=True, transport=transport))
        return made[-1]

    yield make
    for updater in made:
        updater.close()
        updater.client.close()


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SIZE))
        self.register_buffer("b", torch.zeros(5, dtype=torch.int64))


def catch_up(updater: GrpcLocalWeightUpdater, version: int, seconds: float = 20.0) -> None:
    wait_equal(lambda: (updater(), updater.version)[1], version, timeout=seconds, what="the updater's version")


def publish_early(address: str, updater: GrpcLocalWeightUpdater, value: float, over: str = "bulk") -> int:
    """weights_filled(value) published `over` bulk or the stream, held half-way while `updater` is
    called: its follower surely receives the version early."""
    publish = HeldPublish(address, file_of(weights_filled(value)), over)
    for _ in range(30):
        updater()
        time.sleep(0.01)
    version = publish.finish()
    assert version is not None, publish.error
    return version


@pytest.mark.parametrize("transport", ["bulk", "stream"])
def test_the_watching_updater_applies_versions_received_early(server, client, make_updater, transport):
    client.publish(weights_filled(0.0), model=MODEL, transport="stream")
    policy = Linear()
    updater = make_updater(server.address, policy, transport)
    catch_up(updater, 1)
    wait_until(lambda: (updater(), updater.following)[1], timeout=10, step=0.01)  # its Watch stream is open
    for value in (1.0, 2.0):  # held half-way until the follower is receiving: surely early
        weights = weights_filled(value)
        catch_up(updater, publish_early(server.address, updater, value, over=transport))
        assert torch.equal(policy.w.detach(), weights["w"]) and torch.equal(policy.b, weights["b"])
        assert updater.last_fetch.incoming and updater.last_fetch.transport == transport
    weights = weights_filled(3.0)  # and a publish as a trainer makes it
    catch_up(updater, client.publish(weights, model=MODEL, transport=transport))
    assert torch.equal(policy.w.detach(), weights["w"])


@pytest.mark.parametrize("publish_over", ["bulk", "stream"])
def test_the_updater_never_applies_a_publish_cut_half_way(server, client, make_updater, caplog, publish_over):
    client.publish(weights_filled(0.0), model=MODEL, transport="stream")
    policy = Linear()
    updater = make_updater(server.address, policy, "bulk")
    catch_up(updater, 1)
    wait_until(lambda: (updater(), updater.following)[1], timeout=10, step=0.01)
    publish = HeldPublish(server.address, file_of(weights_filled(9.0)), publish_over)
    for _ in range(50):  # its follower hears of the publish and receives its first half
        updater()
        time.sleep(0.005)
    publish.cut()
    # It was receiving the cut publish early: the server cut that transfer short.
    wait_until(
        lambda: (updater(), "(incoming)" in caplog.text and "nothing was committed" in caplog.text)[1],
        step=0.01,
        what="the early transfer cut short",
    )
    for _ in range(20):
        updater()
    w = policy.w.detach()
    assert updater.version == 1 and float(w[0]) == 0.0 and float(w[-1]) == 0.0
    # The next good publish lands whole.
    weights = weights_filled(7.0)
    version = client.publish(weights, model=MODEL, transport="bulk", publish_id=uuid.uuid4().hex)
    catch_up(updater, version)
    assert torch.equal(policy.w.detach(), weights["w"])


def test_a_version_received_early_becomes_the_policy_without_a_copy(server, client, make_updater):
    """Zero-copy apply off the server's host: the parameters become views of the bytes received
    early (once verified), and the buffer they leave is the next receive's, so two buffers serve
    every version; one that a tensor kept from an older version still views is never written again."""
    client.publish(weights_filled(0.0), model=MODEL, transport="stream")
    policy = Linear()
    updater = make_updater(server.address, policy, "bulk")
    catch_up(updater, 1)
    wait_until(lambda: (updater(), updater.following)[1], timeout=10, step=0.01)
    homes = set()
    for value in (1.0, 2.0, 3.0, 4.0):
        catch_up(updater, publish_early(server.address, updater, value))
        assert updater.last_fetch.incoming and updater.zero_copy
        assert torch.equal(policy.w.detach(), torch.full((SIZE,), value)) and torch.equal(policy.b, torch.arange(5))
        homes.add(policy.w.data_ptr())
    assert len(homes) == 2, f"{len(homes)} buffers for 4 versions: each lands in the one its predecessor left"
    kept = policy.w.detach()  # a view of the last version's buffer, kept past the swap away from it
    for value in (5.0, 6.0, 7.0):
        catch_up(updater, publish_early(server.address, updater, value))
        assert updater.zero_copy and policy.w.data_ptr() != kept.data_ptr()
        assert torch.equal(policy.w.detach(), torch.full((SIZE,), value))
    assert torch.equal(kept, torch.full((SIZE,), 4.0))


@pytest.mark.parametrize("transport", ["bulk", "shm"])
def test_keep_storage_copies_every_version_into_the_parameters_own_memory(server, client, transport):
    """keep_storage=True, for code that holds views of the parameters: each version is copied into
    their own memory, off the server's host (received early) and on it (shared memory)."""
    client.publish(weights_filled(0.0), model=MODEL, transport="stream")
    policy = Linear()
    home = policy.w.data_ptr()
    updater = GrpcLocalWeightUpdater(
        server.address, model=MODEL, policy=policy, watch=True, transport=transport, keep_storage=True
    )
    try:
        catch_up(updater, 1)
        wait_until(lambda: (updater(), updater.following)[1], timeout=10, step=0.01)
        for value in (1.0, 2.0):
            catch_up(updater, publish_early(server.address, updater, value))
            assert updater.last_fetch.transport == transport and not updater.zero_copy
            assert (
                updater.last_fetch.incoming == (transport == "bulk")
                and policy.w.data_ptr() == home
                and torch.equal(policy.w.detach(), torch.full((SIZE,), value))
            )
    finally:
        updater.close()
        updater.client.close()


class TricklingPublish(HeldPublish):
    """A publish whose bytes come slowly but steadily: `pieces` parts, `pause` seconds apart (a
    large model over a slow link), so that its whole transfer outlasts an updater's timeout."""

    def __init__(self, address: str, data: bytes, over: str, *, pieces: int, pause: float) -> None:
        self.pieces, self.pause = pieces, pause
        super().__init__(address, data, over)
        self._finish = True
        self._go.set()

    def _parts(self) -> Iterator[bytes]:
        size = -(-len(self.data) // self.pieces)
        for start in range(0, len(self.data), size):
            if start:
                time.sleep(self.pause)
            yield self.data[start : start + size]

    def _bulk(self) -> None:
        header = pb.PublishHeader(model=MODEL, total_bytes=len(self.data), xxh3=self.xxh3)
        answer = negotiate_publish(self.address, [BULK], header)
        with socket.create_connection(("127.0.0.1", answer.payload.bulk.port), timeout=10) as conn:
            conn.sendall(answer.payload.bulk.ticket)
            for part in self._parts():
                conn.sendall(part)
            conn.settimeout(10)
            assert conn.recv(1) == b"\x01"
        self.version = publish_uploaded(self.address, header, answer.upload).version.version

    def _stream(self) -> None:
        header = pb.PublishHeader(model=MODEL, total_bytes=len(self.data), xxh3=self.xxh3)

        def messages() -> Iterator[object]:
            yield pb.PublishRequest(header=header)
            for part in self._parts():
                yield from framing.chunk_messages(part, 1 << 20, framing.PUBLISH_CHUNK_TAG)
            yield pb.PublishRequest(commit=pb.PublishCommit())

        self._call(messages())


@pytest.mark.parametrize("transport", ["bulk", "stream"])
def test_a_publish_slower_than_the_update_timeout_is_still_received_early(server, client, transport, caplog):
    """The early receive runs at its publisher's pace: it is bounded by a stall of update_timeout
    with no bytes landing, not by update_timeout in all, so a large version over a slow link is not
    abandoned part-way and fetched again after its commit (twice the bytes, later)."""
    caplog.set_level(logging.INFO)
    client.publish(weights_filled(0.0), model=MODEL, transport="stream")
    policy = Linear()
    updater = GrpcLocalWeightUpdater(
        server.address, model=MODEL, policy=policy, watch=True, transport=transport, update_timeout=1.0
    )
    try:
        catch_up(updater, 1)
        wait_until(lambda: (updater(), updater.following)[1], timeout=10, step=0.01)
        weights = weights_filled(4.0)
        started = time.monotonic()
        publish = TricklingPublish(server.address, file_of(weights), transport, pieces=16, pause=0.2)
        while publish.version is None and publish.error is None:
            updater()
            time.sleep(0.01)
        assert publish.error is None, publish.error
        assert time.monotonic() - started > 2 * updater.update_timeout  # the transfer outlasted it
        catch_up(updater, publish.version)
        assert torch.equal(policy.w.detach(), weights["w"])
        assert updater.last_fetch.incoming and updater.last_fetch.transport == transport
        assert "early failed" not in caplog.text
    finally:
        updater.close()
        updater.client.close()


@pytest.mark.parametrize("receive_over", ["bulk", "stream"])
def test_an_early_receive_ends_once_no_bytes_land_for_its_timeout(server, other_client, watcher, receive_over):
    """A publish held half-way: its early receive fails, saying why, one timeout after the last
    bytes landed; it never waits for the publish (bounded only by the server's publish timeout)."""
    publish = HeldPublish(server.address, file_of(weights_filled(2.5)), "bulk")
    try:
        announced = watcher.next()
        assert isinstance(announced, IncomingEvent)
        began = time.monotonic()
        with pytest.raises(PublishAborted, match=f"the {receive_over}.* sent nothing for 1s"):
            other_client.fetch_incoming(announced, transport=receive_over, timeout=1.0)
        assert 1.0 <= time.monotonic() - began < 5.0
    finally:
        publish.cut()
