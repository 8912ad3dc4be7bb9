"""Exactly-once publish (issue 14, item 10): a publish carries a client-generated publish id, and
a retry with the same id after a lost reply gets the version the first attempt committed
(the same VersionInfo), never a second version: across a server restart, while the first
attempt is still committing, for a group publish, and from the trainer's updater, whose
retries reuse one id. Replies are lost for real: a TCP proxy on loopback between client and
server forwards the request and throws the reply away."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch
from waiting import wait_until

from weightclient import (
    DeadlineExceeded,
    InvalidRequest,
    ServerUnavailable,
    WeightClient,
    WeightServerError,
    WeightServiceClient,
)
from weightclient.torchrl.grpc_updaters import GrpcRemoteWeightUpdater
from weightserver.process import ServerProcess
from weightserver.protocol.safetensors_format import build_header
from weightserver.storage.commit import Checks
from weightserver.storage.persistence import Disk
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
PUBLISH_ID = "7f1c0a4e-retry-me"


class ReplyDroppingProxy:
    """Forwards TCP connections from 127.0.0.1:`port` to a server. `drop_replies()` makes the
    connections open now throw away whatever the server sends (a reply lost on the way, while
    the request still arrives); `cut()` breaks them. New connections forward both ways."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop_replies(self) -> None:
        with self._lock:
            for _, _, dropping in self._open:
                dropping.set()

    def cut(self) -> None:
        with self._lock:
            connections, self._open = self._open, []
        for client, server, _ in connections:
            for sock in (client, server):
                _close(sock)

    def close(self) -> None:
        _close(self._listener)
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.server_port))
            except OSError:
                _close(client)  # the server is down: the client sees the connection fail
                continue
            dropping = threading.Event()
            with self._lock:
                self._open.append((client, server, dropping))
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, dropping), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, destination: socket.socket, dropping: threading.Event | None) -> None:
        try:
            while data := source.recv(1 << 16):
                if dropping is None or not dropping.is_set():
                    destination.sendall(data)
        except OSError:
            pass
        finally:  # one side ended: end the other too, as a broken connection does
            _close(source)
            _close(destination)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@contextlib.contextmanager
def proxy_to(port: int) -> Iterator[ReplyDroppingProxy]:
    proxy = ReplyDroppingProxy(port)
    try:
        yield proxy
    finally:
        proxy.close()


def payload(n: int, size: int = 1024) -> bytes:
    prefix, _ = build_header([("w", "U8", (size,), size)])
    return prefix + bytes([n % 256]) * size


def latest(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.WeightServiceStub(channel).GetLatest(pb.GetLatestRequest(model=MODEL), timeout=5).version
        except grpc.RpcError:
            return 0


def in_thread(call) -> tuple[threading.Thread, dict]:
    """Run `call()` in a thread; the dict gets its "result" or its "error"."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except WeightServerError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_publish_whose_reply_was_lost_is_committed_once_across_a_restart(tmp_path):
    """The commit lands, the reply is dropped, the server is SIGKILLed and restarted on its
    data dir: the retry with the same publish id gets that version, and nothing more lands."""
    server = ServerProcess("--data-dir", str(tmp_path / "data")).start()
    try:
        with proxy_to(server.port) as proxy, WeightServiceClient(proxy.address) as client:
            assert client.publish_bytes(MODEL, payload(1)).version == 1  # the connection is up
            proxy.drop_replies()
            # Over the stream: the proxy drops the commit's reply (a fast transport's Negotiate
            # reply would be dropped first: test_publish_transports covers that path).
            thread, outcome = in_thread(
                lambda: client.publish_bytes(MODEL, payload(2), publish_id=PUBLISH_ID, timeout=60, transport="stream")
            )
            wait_until(lambda: latest(server.address) == 2)  # committed; its reply goes nowhere
            server.kill()
            thread.join(30)
            assert isinstance(outcome.get("error"), ServerUnavailable), outcome
            server.start()
            first = client.describe(MODEL, 2)
            again = client.publish_bytes(MODEL, payload(2), publish_id=PUBLISH_ID)
            assert again == first
            assert [v.version for v in client.list_versions(MODEL)] == [1, 2]
            # Another publish id is another publish; so is every publish without one, as before.
            assert client.publish_bytes(MODEL, payload(2)).version == 3
            assert client.publish_bytes(MODEL, payload(2), publish_id="").version == 4
            assert client.publish_bytes(MODEL, payload(2), publish_id="").version == 5
        assert "publish_repeat model=policy version=2" in server.log()
    finally:
        server.kill()


def test_the_updater_retrying_after_a_lost_reply_publishes_one_version(make_server, caplog):
    """GrpcRemoteWeightUpdater retries on UNAVAILABLE with the same publish id."""
    server = make_server(shm_dir=None)
    policy = torch.nn.Linear(4, 2)
    with proxy_to(server.port) as proxy, WeightClient(proxy.address) as client:
        updater = GrpcRemoteWeightUpdater(client, policy, retries=3, backoff=0.05, transport="stream")
        assert updater.update_weights() == 1
        with torch.no_grad():
            policy.weight.add_(1.0)
        proxy.drop_replies()
        thread, outcome = in_thread(updater.update_weights)
        wait_until(lambda: server.store.latest(MODEL).version == 2)  # committed, reply dropped
        proxy.cut()  # the connection breaks: the updater sees UNAVAILABLE and retries
        thread.join(30)
        assert outcome == {"result": 2}
        assert [v.version for v in server.store.versions(MODEL)] == [1, 2]
        assert "retry 1/3" in caplog.text
        assert torch.equal(client.fetch(MODEL).tensors["weight"], policy.weight.detach())


def test_a_retry_that_arrives_while_the_first_attempt_is_still_committing_waits_for_it(
    make_server, tmp_path, monkeypatch
):
    """The first attempt's deadline passes while the server is still writing its version; the
    retry, on a new call, finds it once committed and answers with it. The slow disk and the
    count of verified uploads are the storage classes' own methods, wrapped."""
    server = make_server(data_dir=tmp_path / "data")
    write_group, verify = Disk.write_group, Checks.verify
    writing, release, verified = threading.Event(), threading.Event(), []

    def slow_write(disk, records):
        writing.set()
        release.wait(30)
        return write_group(disk, records)

    def counted_verify(*args):
        record = verify(*args)
        verified.append(record)
        return record

    with WeightServiceClient(server.address) as client:
        assert client.publish_bytes(MODEL, payload(1)).version == 1
        monkeypatch.setattr(Disk, "write_group", slow_write)
        monkeypatch.setattr(Checks, "verify", counted_verify)
        try:
            with pytest.raises(DeadlineExceeded):
                client.publish_bytes(MODEL, payload(2), publish_id=PUBLISH_ID, timeout=0.5)
            assert writing.is_set()  # the first attempt is committing, holding the model's commit lock
            thread, outcome = in_thread(lambda: client.publish_bytes(MODEL, payload(2), publish_id=PUBLISH_ID))
            wait_until(lambda: len(verified) == 2)  # the retry was received and checked; now it waits
            release.set()
            thread.join(30)
        finally:
            release.set()
        assert outcome["result"].version == 2
        assert outcome["result"] == client.describe(MODEL, 2)
        assert [v.version for v in client.list_versions(MODEL)] == [1, 2]


def test_a_group_publish_has_one_id_and_a_reused_id_must_mean_the_same_publish(server):
    files = {"policy": payload(1), "critic": payload(2)}
    with WeightServiceClient(server.address) as client:
        first = client.publish_group_bytes(files, publish_id=PUBLISH_ID)
        assert [v.version for v in first] == [1, 1]
        # The same versions; their sha256s may have been computed since the first reply.
        again = client.publish_group_bytes(files, publish_id=PUBLISH_ID)
        assert [replace(v, sha256="") for v in again] == [replace(v, sha256="") for v in first]
        assert [v.version for v in client.list_versions("critic")] == [1]
        with pytest.raises(InvalidRequest, match="other bytes"):
            client.publish_group_bytes({"policy": payload(1), "critic": payload(3)}, publish_id=PUBLISH_ID)
        with pytest.raises(InvalidRequest, match="same models"):
            client.publish_bytes("policy", payload(1), publish_id=PUBLISH_ID)
        assert client.latest("policy").version == 1

    # Only the first header carries the group's id; another one in a later header is refused.
    def stream():
        for i, (model, data) in enumerate(files.items()):
            digest = hashlib.sha256(data).hexdigest()
            header = pb.PublishHeader(model=model, total_bytes=len(data), sha256=digest, publish_id=f"id-{i}")
            yield pb.PublishRequest(header=header)
            yield pb.PublishRequest(chunk=data)
        yield pb.PublishRequest(commit=pb.PublishCommit())

    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.WeightServiceStub(channel).Publish(stream(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one publish id" in caught.value.details()
