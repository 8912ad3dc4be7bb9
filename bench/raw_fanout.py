"""The `raw_fanout` baseline: the limit of the freshness rows' topology with raw sockets.

A trainer process sends N bytes over TCP to one forwarding process, which forwards each MiB as
it arrives to K receiver processes (2 by default), each `recv_into` the memory of its
parameters (a preallocated float32 torch tensor). No framing, no verification. Timed from the
sender's first byte (stamped right before its `sendall`, when the orchestrator's "go" line
arrives) to the last receiver holding the last byte, with CLOCK_MONOTONIC: one clock for every
process on the host, whatever its network namespace. Each transfer follows IDLE_GAP_SECONDS of
idle, as each publish of the freshness rows does (a trainer trains between publishes).

On loopback every process binds 127.0.0.1; on a `bench.link.Link` the sender runs in the
"trainer" namespace, the forwarder in "server" and receiver i in "collector<i>", each bound to
its namespace's address. The roles run as `python -m bench.raw_fanout ROLE ...` (through `ip
netns exec` on a link) and talk to the orchestrator over stdin/stdout lines.
"""

from __future__ import annotations

import argparse
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import WARMUP_ROUNDS, MiB, Row, format_size, log

if TYPE_CHECKING:
    from bench.link import Link

REPO = Path(__file__).resolve().parent.parent
CHUNK = MiB  # the forwarder passes each MiB on as soon as it has it
RECEIVERS = 2
LINE_TIMEOUT = 120.0
IDLE_GAP_SECONDS = 1.0  # = bench.baselines.IDLE_GAP_SECONDS (not imported: the roles stay torch-free)


# ---------------------------------------------------------------------- the roles
def _accept_one(host: str) -> socket.socket:
    with socket.create_server((host, 0)) as listener:
        print(f"listening {listener.getsockname()[1]}", flush=True)
        listener.settimeout(LINE_TIMEOUT)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    received = 0
    while received < view.nbytes:
        got = conn.recv_into(view[received:], view.nbytes - received)
        if not got:
            raise ConnectionError(f"peer closed after {received} of {view.nbytes} bytes")
        received += got


def receive(host: str, nbytes: int, rounds: int) -> None:
    """Receiver: `recv_into` a preallocated float32 tensor's memory, every round; prints
    `done ROUND MONOTONIC` once it holds the round's last byte."""
    import torch

    params = torch.zeros(nbytes // 4)  # written: every page resident
    view = memoryview(params.numpy()).cast("B")
    with _accept_one(host) as conn:
        for i in range(rounds):
            _recv_exactly(conn, view)
            print(f"done {i} {time.monotonic()!r}", flush=True)
    print(f"check {int(view[0] == 0x5A and view[-1] == 0x5A)}", flush=True)


def forward(host: str, targets: list[str], nbytes: int, rounds: int) -> None:
    """Forwarder: connects to every receiver, accepts the sender, and passes each MiB on to
    every receiver (`sendall`, in turn) as soon as the MiB has arrived."""
    outs = []
    for target in targets:
        address, port = target.rsplit(":", 1)
        out = socket.create_connection((address, int(port)), timeout=LINE_TIMEOUT)
        out.settimeout(None)
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        outs.append(out)
    chunk = memoryview(bytearray(CHUNK))
    with _accept_one(host) as conn:
        for _ in range(rounds):
            left = nbytes
            while left:
                piece = chunk[: min(CHUNK, left)]
                _recv_exactly(conn, piece)
                for out in outs:
                    out.sendall(piece)
                left -= piece.nbytes
    for out in outs:
        out.close()


def send(target: str, nbytes: int, rounds: int) -> None:
    """Sender: for every `go` line on stdin, stamps CLOCK_MONOTONIC and `sendall`s N bytes from
    a resident buffer; prints `sent ROUND STAMP`."""
    buffer = memoryview(bytearray(b"\x5a") * nbytes)
    address, port = target.rsplit(":", 1)
    with socket.create_connection((address, int(port)), timeout=LINE_TIMEOUT) as sock:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        print("connected", flush=True)
        for i in range(rounds):
            if not sys.stdin.readline():
                return
            start = time.monotonic()
            sock.sendall(buffer)
            print(f"sent {i} {start!r}", flush=True)


# ---------------------------------------------------------------------- the orchestrator
class _Role:
    """One role's process; its stdout lines arrive on a queue (a reader thread each)."""

    def __init__(self, prefix: list[str], *args: str) -> None:
        command = [*prefix, sys.executable, "-m", "bench.raw_fanout", *args]
        self.name = args[0]
        self.process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"raw-fanout-{self.name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())
        self.lines.put("")  # end of output

    def expect(self, word: str) -> list[str]:
        """The next line, split; it must start with `word`."""
        try:
            line = self.lines.get(timeout=LINE_TIMEOUT)
        except queue.Empty:
            raise TimeoutError(f"raw_fanout {self.name}: no '{word}' line in {LINE_TIMEOUT:g} s") from None
        if not line.startswith(word):
            code = self.process.poll()
            raise RuntimeError(f"raw_fanout {self.name}: expected '{word}', got {line!r} (exit code {code})")
        return line.split()

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


def raw_fanout(
    nbytes: int,
    repeats: int,
    *,
    link: Link | None = None,
    receivers: int = RECEIVERS,
    name: str = "raw_fanout",
    idle: float = IDLE_GAP_SECONDS,
) -> Row:
    """The baseline row: seconds per transfer (GB/s of N per receiver) over WARMUP_ROUNDS
    untimed and `repeats` timed transfers, on loopback or on `link` (hosts "trainer",
    "server", "collector0".. "collector<receivers-1>")."""
    from bench.baselines import throughput_row

    if nbytes % 4:
        raise ValueError(f"{nbytes} bytes is no whole number of float32 parameters")
    rounds = WARMUP_ROUNDS + repeats

    def where(host: str) -> tuple[list[str], str]:
        return ([], "127.0.0.1") if link is None else (link.exec_prefix(host), link.address(host))

    roles: list[_Role] = []
    try:
        targets = []
        for i in range(receivers):
            prefix, address = where(f"collector{i}")
            roles.append(_Role(prefix, "receive", address, str(nbytes), str(rounds)))
        for i, role in enumerate(roles):
            targets.append(f"{where(f'collector{i}')[1]}:{role.expect('listening')[1]}")
        prefix, address = where("server")
        forwarder = _Role(prefix, "forward", address, ",".join(targets), str(nbytes), str(rounds))
        roles.append(forwarder)
        port = forwarder.expect("listening")[1]
        prefix, _ = where("trainer")
        sender = _Role(prefix, "send", f"{address}:{port}", str(nbytes), str(rounds))
        roles.append(sender)
        sender.expect("connected")
        seconds = []
        for i in range(rounds):
            time.sleep(idle)
            sender.tell("go")
            ends = [float(role.expect("done")[2]) for role in roles[:receivers]]
            start = float(sender.expect("sent")[2])
            if i >= WARMUP_ROUNDS:
                seconds.append(max(ends) - start)
        checked = all(role.expect("check")[1] == "1" for role in roles[:receivers])
    finally:
        for role in reversed(roles):
            role.stop()
    where_run = "loopback" if link is None else link.describe()
    note = (
        f"sender -> forwarder -> {receivers} receivers (recv_into a float32 tensor), each MiB forwarded as it "
        f"arrives; sender's first byte -> last receiver's last byte; each after {idle:g} s idle; {where_run}"
    )
    log(f"{name} {format_size(nbytes)}: {sorted(round(s * 1e3, 1) for s in seconds)} ms")
    return throughput_row(name, nbytes, seconds, note=note, receivers=receivers, bytes_arrived=checked)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a raw_fanout role (started by raw_fanout())")
    roles = parser.add_subparsers(dest="role", required=True)
    for role in ("receive", "forward", "send"):
        sub = roles.add_parser(role)
        sub.add_argument("address", help="bind address (receive, forward) or forwarder host:port (send)")
        if role == "forward":
            sub.add_argument("targets", help="comma-separated receiver host:port")
        sub.add_argument("nbytes", type=int)
        sub.add_argument("rounds", type=int)
    args = parser.parse_args(argv)
    if args.role == "receive":
        receive(args.address, args.nbytes, args.rounds)
    elif args.role == "forward":
        forward(args.address, args.targets.split(","), args.nbytes, args.rounds)
    else:
        send(args.address, args.nbytes, args.rounds)


if __name__ == "__main__":
    main()
