"""`weightserver serve` as a child process behind a command prefix (`unshare ...`, a shell
that joins a cgroup first), for tests that need what ServerProcess cannot set up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from weightserver.process import wait_serving


class PrefixedServer:
    """`<prefix> python -m weightserver serve --host 127.0.0.1 --port 0 ARGS...` in `workdir`."""

    def __init__(self, workdir: Path, *args: str, prefix: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        port_file = workdir / "port"
        serve = ["serve", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), *args]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "weightserver", *serve], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server did not start within 30s:\n{self.log()}")
            time.sleep(0.02)
        self.address = f"127.0.0.1:{int(port_file.read_text())}"
        wait_serving(self.address, deadline)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the server (the child of a prefix that forwards no signal, e.g. `unshare
        --fork`, or the process itself after an `exec`) and wait."""
        if self.process.poll() is None:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            for pid in pids or [str(self.process.pid)]:
                os.kill(int(pid), signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # under `unshare --kill-child` the server dies with it
            self.process.wait()
