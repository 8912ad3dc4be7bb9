"""VersionFollower: the newest version of a model that the server has announced, kept current
by a Watch stream in a daemon thread.

An updater that follows the Watch stream asks the server only once a newer version was
announced (and every `watch_confirm_seconds` regardless), instead of one call per batch.
"""

from __future__ import annotations

import logging
import os
import threading

from weightclient.service_client import WeightServiceClient
from weightserver.errors import Cancelled, DeadlineExceeded

log = logging.getLogger(__name__)

RENEW_SECONDS = 30.0  # each Watch call ends after this and is renewed: a stopped follower exits then
RETRY_SECONDS = 1.0  # after a stream failed for good (the client's retry window ran out)


class VersionFollower:
    """Follows `model` from `since` on: `newest()` is the newest version announced, or None
    while no stream is open (not yet, or after a failure: ask the server then). A stream that
    stalls (a stopped server, a silent network) stays open until its renewal: a caller trusts
    it only as long as the server has answered recently (the updater's watch_confirm_seconds)."""

    def __init__(self, client: WeightServiceClient, model: str, since: int) -> None:
        self._client = client
        self._model = model
        self._cursor = since
        self._open = False  # the current stream has delivered an event
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=f"weightclient-follow-{model}", daemon=True)
        self._thread.start()

    def newest(self) -> int | None:
        if os.getpid() != self._pid:
            return None  # a forked child: the thread that kept this current is not here
        with self._lock:
            return self._cursor if self._open else None

    def running(self) -> bool:
        """Whether the thread is alive in this process (not in a forked child, not stopped)."""
        return os.getpid() == self._pid and self._thread.is_alive() and not self._stopped.is_set()

    def stop(self) -> None:
        """Stop following; the thread exits when its current Watch call ends."""
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            # From just before the cursor: the server replays the cursor's version at once (or
            # newer ones, if it was evicted), and the first event marks the stream open.
            since = max(0, self._cursor - 1)
            try:
                for event in self._client.watch(self._model, since=since, timeout=RENEW_SECONDS):
                    with self._lock:
                        self._cursor = max(self._cursor, event.version)
                        self._open = True
                    if self._stopped.is_set():
                        return
            except DeadlineExceeded:
                pass  # the call's renewal: follow on from the cursor
            except (Cancelled, ValueError):
                return  # the client was closed
            except Exception as exc:
                log.info("following %r stopped (%s); asking the server before each update meanwhile", self._model, exc)
                self._stopped.wait(RETRY_SECONDS)
            else:
                self._stopped.wait(RETRY_SECONDS)  # the server ended the stream (it is stopping)
            finally:
                with self._lock:
                    self._open = False
