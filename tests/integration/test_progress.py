"""Progress of publishes and fetches: the client's `progress(done, total)` callback, and the CLI's
bars, which show on a terminal (a real pseudo-terminal here) and never in a pipe."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from weightclient.core.service_client import WeightServiceClient
from weightserver.cli import PROGRESS_MIN_BYTES, TransferProgress
from weightserver.protocol.limits import KiB, MiB
from weightserver.protocol.safetensors_format import build_header

CHUNK = 64 * KiB


def weights(nbytes: int) -> bytes:
    prefix, _ = build_header([("w", "U8", (nbytes,), nbytes)])
    return prefix + b"\x05" * nbytes


def assert_counts_up_to(calls: list[tuple[int, int]], total: int, *, at_least: int) -> None:
    assert len(calls) >= at_least, calls
    assert all(t == total for _, t in calls), calls
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == total, calls


def test_publish_reports_every_chunk_up_to_the_total(server):
    data = weights(5 * CHUNK + 123)
    calls: list[tuple[int, int]] = []
    with WeightServiceClient(server.address, chunk_bytes=CHUNK) as client:
        client.publish_bytes(
            "policy", data, transport="stream", progress=lambda done, total: calls.append((done, total))
        )
    assert_counts_up_to(calls, len(data), at_least=6)
    assert calls[0][0] == CHUNK


def test_group_publish_counts_all_models(server):
    policy, critic = weights(3 * CHUNK), weights(2 * CHUNK)
    calls: list[tuple[int, int]] = []
    with WeightServiceClient(server.address, chunk_bytes=CHUNK) as client:
        client.publish_group_bytes(
            {"policy": policy, "critic": critic},
            transport="stream",
            progress=lambda done, total: calls.append((done, total)),
        )
    assert_counts_up_to(calls, len(policy) + len(critic), at_least=5)


def test_stream_fetch_reports_every_chunk_up_to_the_total(server):
    data = weights(4 * CHUNK + 7)
    calls: list[tuple[int, int]] = []
    with WeightServiceClient(server.address, chunk_bytes=CHUNK) as client:
        client.publish_bytes("policy", data)
        fetched = client.fetch_bytes(
            "policy", transport="stream", progress=lambda done, total: calls.append((done, total))
        )
    assert fetched is not None and bytes(fetched.data) == data
    assert_counts_up_to(calls, len(data), at_least=5)


@pytest.mark.parametrize("transport", ["bulk", "shm"])
def test_fast_path_fetch_reports_the_total_once(server, transport):
    data = weights(4 * CHUNK)
    calls: list[tuple[int, int]] = []
    with WeightServiceClient(server.address, chunk_bytes=CHUNK) as client:
        client.publish_bytes("policy", data)
        fetched = client.fetch_bytes("policy", transport=transport, progress=lambda d, t: calls.append((d, t)))
    assert fetched is not None and fetched.stats is not None and fetched.stats.transport == transport
    assert calls == [(len(data), len(data))]


def test_up_to_date_fetch_reports_nothing(server):
    calls: list[tuple[int, int]] = []
    with WeightServiceClient(server.address) as client:
        client.publish_bytes("policy", weights(100))
        assert client.fetch_bytes("policy", newer_than=1, progress=lambda d, t: calls.append((d, t))) is None
    assert calls == []


# ---------------------------------------------------------------------- the CLI's bars
def run_cli(*args: str, terminal: bool) -> tuple[int, str, str]:
    """`weightserver ARGS` with stderr on a pseudo-terminal (or a pipe); exit code, stdout, stderr."""
    command = [sys.executable, "-m", "weightserver", *args]  # the `weightserver` console script
    if not terminal:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return result.returncode, result.stdout, result.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    received = bytearray()
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal (it exited)
            break
        if not data:
            break
        received += data
    os.close(leader)
    assert process.stdout is not None
    with process.stdout:
        stdout = process.stdout.read().decode()
    return process.wait(timeout=60), stdout, received.decode(errors="replace")


@pytest.fixture
def large_file(tmp_path):
    path = tmp_path / "large.safetensors"
    path.write_bytes(weights(PROGRESS_MIN_BYTES))
    return path


def test_cli_shows_bars_on_a_terminal(server, large_file, tmp_path):
    code, out, err = run_cli("publish", str(large_file), "--model", "policy", "--server", server.address, terminal=True)
    assert code == 0, err
    assert out.strip() == "1"
    assert "publish policy" in err and "100%" in err

    output = tmp_path / "fetched.safetensors"
    code, out, err = run_cli("fetch", "--model", "policy", "-o", str(output), "--server", server.address, terminal=True)
    assert code == 0, err
    assert "fetch policy" in err and "100%" in err
    assert output.read_bytes() == large_file.read_bytes()


def test_cli_shows_no_bar_in_a_pipe(server, large_file, tmp_path):
    code, out, err = run_cli(
        "publish", str(large_file), "--model", "policy", "--server", server.address, terminal=False
    )
    assert (code, out.strip(), err) == (0, "1", "")
    output = tmp_path / "fetched.safetensors"
    code, out, err = run_cli(
        "fetch", "--model", "policy", "-o", str(output), "--server", server.address, terminal=False
    )
    assert code == 0 and err == ""
    assert "policy v1" in out and "%" not in out


def test_cli_shows_no_bar_for_small_files_on_a_terminal(server, tmp_path):
    small = tmp_path / "small.safetensors"
    small.write_bytes(weights(MiB))
    code, out, err = run_cli("publish", str(small), "--model", "policy", "--server", server.address, terminal=True)
    assert (code, out.strip()) == (0, "1")
    assert "%" not in err and "publish policy" not in err


def test_progress_starts_over_when_the_transfer_does():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with open(follower, "w") as terminal, TransferProgress("fetch policy", stream=terminal, min_bytes=10) as progress:
        progress(60, 100)
        progress(20, 100)  # a retry from the start
        assert progress.bar is not None and progress.bar.n == 20
        progress(100, 100)
        assert progress.bar.n == 100
    os.close(leader)
