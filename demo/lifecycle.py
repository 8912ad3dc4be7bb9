"""How a demo process ends: on its own, on SIGTERM/SIGINT, or when its parent dies.

The first SIGTERM or SIGINT asks for a clean stop (finish the batch, report, exit 0); a second
one exits at once. Once the process's work is done, both are ignored: compose stops every service
when the trainer exits, and a SIGTERM that lands while the interpreter shuts down (when Python's
handlers are already gone) would otherwise kill a collector that finished cleanly (exit 143).
A process started by the orchestrator also asks the kernel for a SIGTERM
when the orchestrator dies (Linux `PR_SET_PDEATHSIG`), so even a SIGKILLed orchestrator leaves
no orphans behind.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType

PARENT_PID_ENV = "DEMO_PARENT_PID"
_PR_SET_PDEATHSIG = 1
# Looked up at import: `parent_death_signal` also runs between fork and exec, where only a
# plain function call is safe.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class StopRequest:
    """Set by the first SIGTERM/SIGINT; `wait(seconds)` sleeps but wakes up on a stop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> StopRequest:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set():
            sys.exit(128 + signum)  # a second signal: stop now
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def ignore_from_now(self) -> None:
        """The work is done: SIGTERM/SIGINT have nothing left to stop. Python restores the
        default action (terminate) early in interpreter shutdown for signals it handles, but
        leaves ignored ones ignored."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux only)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent() -> None:
    """If the orchestrator started us (it sets $DEMO_PARENT_PID), end when it ends."""
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected:
        return
    parent_death_signal()
    if os.getppid() != int(expected):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run_role(
    run: Callable[[argparse.Namespace, StopRequest], int],
    argv: list[str] | None,
    options: Iterable[str],
    prog: str,
    description: str,
) -> int:
    """The `main` of a demo process (trainer, collector): stop on SIGTERM/SIGINT, die with the
    orchestrator, read flags and environment, then `run(args, stop)`."""
    from demo import config

    stop = StopRequest().install()
    die_with_parent()
    args = config.parse(argv, options, prog, description, required=["spool_dir"])
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    code = run(args, stop)
    stop.ignore_from_now()
    # The interpreter's last collection walks every object torch and torchrl made; on a busy
    # machine that took seconds after a SIGTERM (compose kills a stop 10 s after it). Objects
    # frozen here are left to the process's exit.
    gc.freeze()
    return code
