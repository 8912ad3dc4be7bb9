"""StagedUploads: the uploads Negotiate sets up (bulk, shared memory), at most `_max` at once."""

from __future__ import annotations

import threading

import pytest

from weightserver.protocol.errors import TooManyUploads
from weightserver.publish.incoming import IncomingPublishes
from weightserver.publish.receiver import IncomingModel
from weightserver.publish.staged_uploads import StagedUploads


def test_uploads_set_up_at_once_stay_within_the_limit(monkeypatch):
    """Two Negotiates (each in a thread of its own) setting uploads up at once on a server that
    holds one: the second is TooManyUploads. Before, the count was checked before the buffer was
    allocated and the upload added after, so every call allocating meanwhile passed the check:
    both were set up, each holding a model's size of memory, over the limit."""
    allocating, go_on = threading.Event(), threading.Event()
    allocate = IncomingModel.allocate

    def slow_allocate(self: IncomingModel, *, populate: bool = False) -> None:
        if not allocating.is_set():  # the first call allocates a large buffer: it takes a while
            allocating.set()
            assert go_on.wait(10)
        allocate(self, populate=populate)

    monkeypatch.setattr(IncomingModel, "allocate", slow_allocate)
    staged = StagedUploads({}, IncomingPublishes(), None)
    staged._max = 1
    try:
        first = threading.Thread(target=staged.create, args=("policy", 64, "bulk"))
        first.start()
        assert allocating.wait(10)
        try:
            with pytest.raises(TooManyUploads):
                staged.create("critic", 64, "bulk")
        finally:
            go_on.set()
            first.join(10)
        assert staged.transports() == ["bulk"]
    finally:
        staged.close()
