"""FetchReports: telling the server about fetches it did not serve, without making them wait.

A version read straight from the server's shared memory (see `transports.shared_memory`) never reached the
server, yet its metrics and logs (bytes served, each client's version) should count it. The
client reports such a read with the Negotiate call it skipped, from a thread of its own, after the
bytes moved. One report is in flight at a time; reads made meanwhile wait behind it and only
the latest is sent (the server then counts a burst of direct reads as one, with the latest
version, which is what its per-client version gauge needs).

A thread with blocking calls, not `Negotiate.future()`: grpcio starts a new thread for a future
whenever none is outstanding on the channel, which cost about 0.8 ms per report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weightserver.v1 import weights_pb2 as pb

log = logging.getLogger(__name__)


class FetchReports:
    """Reports sent one at a time, in a daemon thread started on the first, through `send`
    (a blocking Negotiate call)."""

    def __init__(self, send: Callable[[pb.FetchRequest], object]) -> None:
        self._send = send
        self._changed = threading.Condition()
        self._waiting: pb.FetchRequest | None = None
        self._sending = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def report(self, request: pb.FetchRequest) -> None:
        with self._changed:
            if self._closed:
                return
            self._waiting = request
            if self._thread is None or not self._thread.is_alive():  # not yet, or in a forked child
                self._thread = threading.Thread(target=self._run, name="weightclient-fetch-reports", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report was sent (answered or failed); False if `timeout` passed."""
        with self._changed:
            return self._changed.wait_for(lambda: self._waiting is None and not self._sending, timeout)

    def close(self) -> None:
        """Stop: a report not yet sent is dropped (reports are for metrics, not correctness)."""
        with self._changed:
            self._closed = True
            self._waiting = None
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return  # closed
                request, self._waiting = self._waiting, None
                self._sending = True
            try:
                self._send(request)
            except Exception as exc:  # the server's answer changes nothing for the caller
                log.debug("the server did not take the report of %s v%d: %s", request.model, request.version, exc)
            finally:
                with self._changed:
                    self._sending = False
                    self._changed.notify_all()
