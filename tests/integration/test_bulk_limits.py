"""The bulk TCP port under abuse and the bulk client under a stalled server, with real server
processes where threads, file descriptors and pids are what is measured: idle connections by
the thousand, a pids limit, running out of file descriptors, a port that never answers, and a
server stopped (SIGSTOP) part-way through a transfer. Other clients must keep being served."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from launch import PrefixedServer
from waiting import wait_for, wait_until

import weightclient.transports.bulk as bulk_transport
import weightserver.transports.bulk as bulk
from weightclient import WeightClient
from weightserver.process import ServerProcess
from weightserver.protocol.errors import DeadlineExceeded
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MiB = 1 << 20
MODEL = "policy"


def weights(seed: int, size: int = 8 * MiB) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(size // 4, dtype=torch.float32) + seed}


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for pid {pid}")


def bulk_port_of(address: str) -> int:
    """The bulk port a server hands out, read from a real bulk fetch."""
    with WeightClient(address) as client:
        result = client.fetch_bytes(MODEL, transport="bulk", timeout=30)
        assert result.stats.transport == "bulk"
        return client.transports.by_name["bulk"].port


@contextlib.contextmanager
def idle_connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    """TCP connections to `port` that never send a byte, closed on exit: `count` tried, those
    that the server did not reset while they were being made."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 200:
        if hard != resource.RLIM_INFINITY and hard < count + 200:
            pytest.skip(f"{count} connections need more file descriptors than the hard limit of {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count + 200, hard))
    conns: list[socket.socket] = []
    try:
        for _ in range(count):
            with contextlib.suppress(ConnectionError):  # reset at once: over the server's cap
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        yield conns
    finally:
        for conn in conns:
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_by_peer(conn: socket.socket) -> bool:
    """Whether the server closed `conn` (EOF or reset is waiting to be read); never waits."""
    timeout = conn.gettimeout()
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        conn.settimeout(timeout)


def negotiate_bulk(address: str) -> pb.Payload:
    """A bulk ticket for the latest version, asked for with the generated stub."""
    request = pb.NegotiateRequest(
        direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_BULK], fetch=pb.FetchRequest(model=MODEL)
    )
    with grpc.insecure_channel(address) as channel:
        answer = pb_grpc.WeightServiceStub(channel).Negotiate(request, timeout=30)
    assert answer.transport == pb.TRANSPORT_BULK
    return answer.payload


def fetch_timed(address: str, transport: str = "bulk", timeout: float = 30) -> tuple[str, float, torch.Tensor]:
    """A fresh client's fetch: (transport used, seconds, tensor)."""
    with WeightClient(address) as client:
        started = time.monotonic()
        result = client.fetch(MODEL, transport=transport, timeout=timeout)
        return result.stats.transport, time.monotonic() - started, result.tensors["w"]


# ---------------------------------------------------------------------- item 8: connection cap
def test_two_thousand_idle_bulk_connections_add_no_threads_and_others_are_served():
    """2,000 connections that never send a ticket. Before the fix each got a thread for up to
    600 s (2,012 server threads). Now one event loop serves at most --bulk-max-connections,
    the rest are closed at once, a normal client falls back to the stream at once, the idle
    ones are dropped after FIRST_TICKET_SECONDS, and bulk serves again."""
    with ServerProcess("--no-shm") as server, WeightClient(server.address) as client:
        client.publish(weights(1), model=MODEL)
        port = bulk_port_of(server.address)
        pid = server.process.pid
        before = threads_of(pid)
        with idle_connections(port, 2000) as conns:
            # Once the server has accepted (or refused) them all: no thread for any.
            wait_for(
                lambda: 2000 - len(conns) + sum(closed_by_peer(c) for c in conns),
                lambda refused: refused >= 2000 - bulk.DEFAULT_MAX_CONNECTIONS,
                what="connections over the cap refused",
            )
            assert threads_of(pid) <= before + 2, f"{threads_of(pid)} threads, {before} before"

            used, seconds, tensor = fetch_timed(server.address)  # the cap is full: the stream, at once
            assert used == "stream" and seconds < 3, (used, seconds)
            assert torch.equal(tensor, weights(1)["w"])

            # A new connection must send its ticket within FIRST_TICKET_SECONDS.
            wait_until(lambda: all(closed_by_peer(c) for c in conns), timeout=bulk.FIRST_TICKET_SECONDS + 5)
            used, seconds, tensor = fetch_timed(server.address)
            assert used == "bulk" and torch.equal(tensor, weights(1)["w"]), used
        assert threads_of(pid) <= before + 2
    assert "the most --bulk-max-connections allows" in server.log()


def test_bulk_max_connections_is_a_serve_flag():
    with ServerProcess("--no-shm", "--bulk-max-connections", "3") as server, WeightClient(server.address) as client:
        client.publish(weights(1, MiB), model=MODEL, transport="stream")  # keeps no bulk connection open
        port = bulk_port_of(server.address)
        time.sleep(0.3)  # the server notices that the connection of bulk_port_of's client closed
        with idle_connections(port, 4) as conns:
            time.sleep(0.2)
            assert sum(closed_by_peer(c) for c in conns) + 4 - len(conns) == 1  # the fourth
            used, seconds, _ = fetch_timed(server.address)
            assert used == "stream" and seconds < 3
        wait_until(lambda: fetch_timed(server.address)[0] == "bulk", timeout=10)
    assert "at most 3 connections" in server.log()


def test_the_bulk_accept_loop_survives_running_out_of_file_descriptors():
    """The server runs out of file descriptors while connections pour in. Before the fix the
    accept thread ended on EMFILE and bulk stayed dead (clients waited 30 s, then streamed)."""
    with ServerProcess("--no-shm") as server, WeightClient(server.address) as client:
        client.publish(weights(1), model=MODEL)
        port = bulk_port_of(server.address)
        pid = server.process.pid
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        limit = len(os.listdir(f"/proc/{pid}/fd")) + 30
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
        with idle_connections(port, 150):
            wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) >= limit, timeout=10)
            time.sleep(0.5)  # accepts fail now (EMFILE); the rest wait in the listen backlog
        assert server.process.poll() is None
        # The descriptors are free again: bulk serves, within the accept loop's longest pause.
        wait_until(lambda: fetch_timed(server.address, timeout=10)[0] == "bulk", timeout=15)
        used, _, tensor = fetch_timed(server.address)
        assert used == "bulk" and torch.equal(tensor, weights(1)["w"])
        assert client.publish(weights(2), model=MODEL) == 2  # gRPC serves too
    assert "accept failed" in server.log()


@pytest.fixture
def pids_cgroup(tmp_path: Path) -> Iterator[Path]:
    """A fresh cgroup with the pids controller (v1 or v2), removed after the test."""
    if os.geteuid() != 0:
        pytest.skip("a pids cgroup needs root (CI runs these tests as root)")
    v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists():
        parent = v1
    elif "pids" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else ():
        parent = v2
        with contextlib.suppress(OSError):
            (v2 / "cgroup.subtree_control").write_text("+pids")
    else:
        pytest.skip("no pids cgroup controller on this machine")
    group = parent / f"weightserver-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup under {parent}: {exc}")
    try:
        if not (group / "pids.max").exists():
            pytest.skip(f"{group} has no pids.max (the pids controller is not enabled there)")
        yield group
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def test_idle_bulk_connections_under_a_pids_limit_leave_the_server_serving(pids_cgroup, tmp_path):
    """A server whose cgroup allows a few more tasks than it runs. Before the fix 200 idle
    connections made 200 threads: thread creation failed, the accept thread died and bulk
    stayed dead (each client then waited 30 s before streaming)."""
    join = ["sh", "-c", f'echo $$ > {pids_cgroup / "cgroup.procs"} && exec "$@"', "sh"]
    server = PrefixedServer(tmp_path / "server", "--no-shm", prefix=join)
    try:
        with WeightClient(server.address) as client:
            client.publish(weights(1), model=MODEL)
            port = bulk_port_of(server.address)
            assert fetch_timed(server.address, "stream")[0] == "stream"
            pids_current = int((pids_cgroup / "pids.current").read_text())
            (pids_cgroup / "pids.max").write_text(str(pids_current + 16))
            with idle_connections(port, 200):
                time.sleep(0.5)
                assert server.process.poll() is None
            used, seconds, tensor = fetch_timed(server.address)
            assert used == "bulk" and seconds < 5, (used, seconds)
            assert torch.equal(tensor, weights(1)["w"])
            assert client.publish(weights(2), model=MODEL) == 2
        assert "can't start new thread" not in server.log()
    finally:
        server.stop()


def test_a_bulk_port_that_never_answers_sends_the_fetch_to_the_stream_promptly(make_server):
    """Tickets name a port whose connections are never served (a wedged accept loop, a full
    backlog). Before the fix the client waited 30 s for the first byte; now FIRST_BYTE_TIMEOUT."""
    srv = make_server(shm_dir=None)
    with socket.create_server(("127.0.0.1", 0), backlog=16) as black_hole, WeightClient(srv.address) as client:
        client.publish(weights(1, MiB), model=MODEL)
        srv.bulk.port = black_hole.getsockname()[1]  # listening, never accepting
        started = time.monotonic()
        result = client.fetch(MODEL, transport="bulk", timeout=60)
        seconds = time.monotonic() - started
        assert result.stats.transport == "stream" and torch.equal(result.tensors["w"], weights(1, MiB)["w"])
        assert seconds < bulk_transport.FIRST_BYTE_TIMEOUT + 3, seconds
        assert not client.transports.by_name["bulk"].connected  # dropped


def test_silent_idle_and_stalled_bulk_connections_are_dropped(make_server, monkeypatch, caplog):
    """A connection that sends no ticket, one idle after its transfer, and one whose reader
    takes nothing: each is closed by the server after its limit and frees its place."""
    monkeypatch.setattr(bulk, "FIRST_TICKET_SECONDS", 0.5, raising=False)
    monkeypatch.setattr(bulk, "SEND_STALL_SECONDS", 0.5, raising=False)
    srv = make_server(shm_dir=None)
    with WeightClient(srv.address) as client:
        client.publish(weights(1, 64 * MiB), model=MODEL)
        with socket.create_connection(("127.0.0.1", srv.bulk.port), timeout=10) as silent:
            started = time.monotonic()
            assert silent.recv(1) == b""  # closed after FIRST_TICKET_SECONDS, not the idle limit
            assert time.monotonic() - started < 3

        monkeypatch.setattr(bulk, "IDLE_CONNECTION_SECONDS", 0.5)
        assert client.fetch(MODEL, transport="bulk", timeout=30).stats.transport == "bulk"
        wait_until(lambda: srv.bulk.connections == 0, timeout=5)
        assert client.fetch(MODEL, transport="bulk", timeout=30).stats.transport == "bulk"  # reconnects
        wait_until(lambda: srv.bulk.connections == 0, timeout=5)

        # A reader that sends its ticket and reads nothing: dropped once SEND_STALL_SECONDS pass.
        ticket = negotiate_bulk(srv.address).bulk.ticket
        with socket.socket() as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            stalled.connect(("127.0.0.1", srv.bulk.port))
            stalled.sendall(ticket)
            wait_until(lambda: srv.bulk.connections == 1, timeout=5)
            wait_until(lambda: srv.bulk.connections == 0, timeout=5)
    assert "stalled" in caplog.text


def test_a_ticket_sent_a_byte_at_a_time_is_still_due_within_the_limit(make_server, monkeypatch):
    """A new connection must send its ticket within FIRST_TICKET_SECONDS (docs/guides/limits.md).
    The limit applied to each wait for a byte, so a peer sending a byte just under it each time
    held its place 16 times as long (160 s by default, 256 such peers: the whole port)."""
    monkeypatch.setattr(bulk, "FIRST_TICKET_SECONDS", 0.5, raising=False)
    srv = make_server(shm_dir=None)
    with socket.create_connection(("127.0.0.1", srv.bulk.port), timeout=10) as dripping:
        started = time.monotonic()
        closed = False
        for _ in range(bulk.TICKET_BYTES - 1):  # a byte every 0.2 s: never 0.5 s without one
            try:
                dripping.sendall(b"x")
                time.sleep(0.2)  # the peer's pace, not a wait for the server
                readable, _, _ = select.select([dripping], [], [], 0)
                closed = bool(readable) and dripping.recv(1) == b""
            except ConnectionResetError:
                closed = True
            if closed:
                break
        assert closed, "the connection stayed open while its ticket arrived a byte at a time"
        assert time.monotonic() - started < 0.5 + 1.5
        wait_until(lambda: srv.bulk.connections == 0, timeout=5)


# ---------------------------------------------------------------------- item 7: deadlines
class SlowSocket(socket.socket):
    """A client socket that reads at most 1 MiB per call, 50 per second, and stops the server
    (SIGSTOP) once `stop_after` bytes have arrived."""

    server_pid = 0
    stop_after = 0
    received = 0

    def recv_into(self, buffer, nbytes=0, flags=0):  # type: ignore[override]
        view = memoryview(buffer)[: min(len(memoryview(buffer)), 1 * MiB)]
        time.sleep(0.02)
        n = super().recv_into(view, 0, flags)
        SlowSocket.received += n
        if SlowSocket.received >= SlowSocket.stop_after and SlowSocket.server_pid:
            os.kill(SlowSocket.server_pid, signal.SIGSTOP)
            SlowSocket.server_pid = 0
        return n


def test_a_bulk_fetch_ends_at_its_deadline_when_the_server_stops_mid_transfer(monkeypatch):
    """The server is stopped (SIGSTOP) after 8 MiB of a 64 MiB bulk transfer. Before the fix
    fetch_bytes(timeout=3) waited 30 s per recv, then fell back to a stream with a fresh 3 s.
    Now it raises DeadlineExceeded at 3 s, drops the connection, and works again after SIGCONT."""
    server = ServerProcess("--no-shm").start()
    try:
        with WeightClient(server.address) as client:
            client.publish(weights(1, 64 * MiB), model=MODEL, transport="stream")  # no kept bulk connection
            connect = bulk_transport._connect

            def slow_connect(*args):
                conn = connect(*args)
                timeout = conn.gettimeout()
                slow = SlowSocket(conn.family, conn.type, conn.proto, fileno=conn.detach())
                slow.settimeout(timeout)
                return slow

            monkeypatch.setattr(bulk_transport, "_connect", slow_connect)
            SlowSocket.server_pid, SlowSocket.stop_after = server.process.pid, 8 * MiB
            outcome: list[object] = []

            def fetch() -> None:
                started = time.monotonic()
                try:
                    outcome.append(client.fetch_bytes(MODEL, transport="bulk", timeout=3))
                except Exception as exc:
                    outcome.append(exc)
                outcome.append(time.monotonic() - started)

            fetcher = threading.Thread(target=fetch, daemon=True)
            fetcher.start()
            fetcher.join(timeout=6)
            assert not fetcher.is_alive(), "the fetch is still blocked 6 s into a 3 s timeout"
            error, seconds = outcome
            assert isinstance(error, DeadlineExceeded), error
            assert 2.5 < seconds < 4.5, seconds
            assert "bulk" in str(error) and not client.transports.by_name["bulk"].connected
            assert SlowSocket.server_pid == 0  # the server was stopped mid-transfer

            os.kill(server.process.pid, signal.SIGCONT)
            monkeypatch.setattr(bulk_transport, "_connect", connect)
            result = client.fetch(MODEL, transport="bulk", timeout=30)
            assert result.stats.transport == "bulk" and torch.equal(result.tensors["w"], weights(1, 64 * MiB)["w"])
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop(timeout=30)
