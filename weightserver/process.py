"""`weightserver serve` in a child process, for demos and tests that need restarts or SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ServerProcess:
    """``python -m weightserver serve ARGS`` on 127.0.0.1; `port` 0 picks a free port once, kept across
    restarts. `start()` returns once the health service says SERVING; `prefix` wraps the command."""

    def __init__(
        self,
        *args: str,
        port: int = 0,
        log_path: str | os.PathLike[str] | None = None,
        prefix: Sequence[str] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        if credentials is None and any(a == "--tls-cert" or a.startswith("--tls-cert=") for a in args):
            raise ValueError("a server started with --tls-cert serves TLS only: give credentials= trusting its CA")
        self.credentials, self.port = credentials, port
        self.args, self.prefix = list(args), list(prefix)
        self._workdir = Path(tempfile.mkdtemp(prefix="weightserver-proc-"))
        self.log_path = Path(log_path) if log_path else self._workdir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        port_file = self._workdir / "port"
        port_file.unlink(missing_ok=True)
        serve = ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--port-file", str(port_file), *self.args]
        command = [*self.prefix, sys.executable, "-m", "weightserver", *serve]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server did not start within {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        try:
            wait_serving(self.address, deadline, self.credentials)
        except (grpc.RpcError, TimeoutError):
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful shutdown) and wait; returns the exit code."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return 0 if self.process is None else self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


def wait_serving(address: str, deadline: float, credentials: grpc.ChannelCredentials | None = None) -> None:
    """Poll `address`'s health service until SERVING; past `deadline` (monotonic) raise the last error,
    or TimeoutError where the server answered with another status."""
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            else:
                if time.monotonic() > deadline:
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    raise TimeoutError(f"{address} answers {status}, not SERVING")
            time.sleep(0.02)
