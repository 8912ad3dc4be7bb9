"""`weightserver serve` as a child process behind a command prefix (`unshare ...`, a shell
that joins a cgroup first), for tests that need what a plain ServerProcess cannot set up."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from weightserver.process import ServerProcess


class PrefixedServer(ServerProcess):
    """`<prefix> python -m weightserver serve --host 127.0.0.1 --port 0 ARGS...`, started at
    once, logging to `workdir`/server.log."""

    def __init__(self, workdir: Path, *args: str, prefix: Sequence[str] = ()) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(*args, log_path=workdir / "server.log", prefix=prefix)
        self.start()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the server (the child of a prefix that forwards no signal, e.g. `unshare
        --fork`, or the process itself after an `exec`) and wait."""
        assert self.process is not None
        if self.process.poll() is None:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            for pid in pids or [str(self.process.pid)]:
                os.kill(int(pid), signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()  # under `unshare --kill-child` the server dies with it
            raise
