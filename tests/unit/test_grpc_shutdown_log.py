"""gRPC logs a call cancelled before its handler ran (the server stopping just as a Watch
arrives) as an ERROR with the CancelledError; the server drops exactly those records, so that an
audit counting ERROR lines (bench/chaos.py) sees only real faults."""

from __future__ import annotations

import asyncio
import logging

import weightserver.server  # noqa: F401  (installs the filter)


def test_only_cancelled_calls_are_dropped_from_grpcs_log():
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("grpc._cython.cygrpc")
    logger.addHandler(handler)
    try:
        for error in (asyncio.CancelledError(), ValueError("a real fault")):
            try:
                raise error
            except BaseException:
                logger.exception("Exception not handled by _handle_exceptions in servicer method [%s]", "Watch")
        logger.error("an error without an exception")
    finally:
        logger.removeHandler(handler)
    assert [r.exc_info[0] if r.exc_info else None for r in seen] == [ValueError, None]
