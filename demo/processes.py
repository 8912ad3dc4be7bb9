"""Child processes of the orchestrator: the weight server, the trainer and the collectors.

Each child runs in a session of its own, so a Ctrl-C in the terminal reaches only the
orchestrator, which then stops the children in order (trainer and collectors first, so that
they can report, then the server). Children also get SIGTERM from the kernel if the
orchestrator dies (see `demo.lifecycle`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from demo.lifecycle import parent_death_signal
from demo.output import say
from weightserver.process import wait_serving

REPO = Path(__file__).resolve().parents[1]


class Child:
    """One child process with a name, started in its own session."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdout: IO[bytes] | None = None,
        death_signal: bool = False,
    ) -> None:
        self.name = name
        self.death_signal = death_signal
        self.command = list(command)
        self.env = dict(env) if env is not None else None
        self.stdout = stdout
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.process = subprocess.Popen(
            self.command,
            cwd=REPO,
            env=self.env,
            stdout=self.stdout,
            stderr=subprocess.STDOUT if self.stdout is not None else None,
            start_new_session=True,
            # One prctl call between fork and exec: only for the server, started before the
            # orchestrator has any threads (the demo's own processes ask for it themselves).
            preexec_fn=parent_death_signal if self.death_signal else None,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else 0

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, timeout: float) -> int:
        """SIGTERM (one: a second one means "now" to the demo's processes), wait up to
        `timeout`, then SIGKILL; returns the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        """Wait up to `timeout` for the exit, then SIGKILL; returns the exit code."""
        if self.process is None:
            return 0
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            say("demo", f"{self.name} did not stop within {timeout:.0f}s: killing it")
            self.process.kill()
            return self.process.wait()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_server(
    workdir: Path, port: int, data_dir: str | None, log: IO[bytes], timeout: float = 60.0
) -> tuple[Child, str]:
    """`python -m weightserver serve` on 127.0.0.1; returns once its health service says SERVING."""
    port_file = workdir / "server.port"
    command = python_module(
        "weightserver", "serve", "--host", "127.0.0.1", "--port", str(port), "--port-file", str(port_file)
    )
    if data_dir:
        command += ["--data-dir", data_dir]
    server = Child("weightserver", command, stdout=log, death_signal=True).start()
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if server.poll() is not None:
            raise RuntimeError(f"weightserver exited with {server.poll()} (log: {log.name})")
        if time.monotonic() > deadline:
            server.stop(5)
            raise TimeoutError(f"weightserver did not start within {timeout:.0f}s (log: {log.name})")
        time.sleep(0.02)
    address = f"127.0.0.1:{int(port_file.read_text())}"
    wait_serving(address, deadline)
    return server, address


def child_env(settings: Mapping[str, str]) -> dict[str, str]:
    """This process's environment plus `settings`, and our pid for `die_with_parent`."""
    return {**os.environ, **settings, "DEMO_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
