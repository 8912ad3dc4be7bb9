"""StagedUploads: the uploads Negotiate sets up (bulk, shared memory), at most MAX_STAGED_UPLOADS at once."""

from __future__ import annotations

import threading

import pytest

from weightserver.protocol.errors import TooManyUploads
from weightserver.publish import staged_uploads
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
    monkeypatch.setattr(staged_uploads, "MAX_STAGED_UPLOADS", 1)
    staged = StagedUploads({}, IncomingPublishes(), None)
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


def test_an_upload_set_up_while_they_close_is_let_go(monkeypatch):
    """A Negotiate still allocating its upload when the server stops (its handler cancelled, its
    thread not) gets no upload. Before, the upload was added after `close` had let every upload
    go and the sweeper had stopped: it held its buffer for as long as the server object lived."""
    allocating, go_on = threading.Event(), threading.Event()
    allocate, discarded = IncomingModel.allocate, []

    def slow_allocate(self: IncomingModel, *, populate: bool = False) -> None:
        allocating.set()
        assert go_on.wait(10)
        allocate(self, populate=populate)

    monkeypatch.setattr(IncomingModel, "allocate", slow_allocate)
    monkeypatch.setattr(IncomingModel, "discard", lambda self, why="": discarded.append(self.model))
    staged, failed = StagedUploads({}, IncomingPublishes(), None), []

    def create() -> None:
        try:
            staged.create("policy", 64, "bulk")
        except OSError as exc:  # as when no buffer can be had: the transport declines, the caller streams
            failed.append(exc)

    setting_up = threading.Thread(target=create)
    setting_up.start()
    assert allocating.wait(10)
    staged.close()
    go_on.set()
    setting_up.join(10)
    assert len(staged) == 0 and discarded == ["policy"]
    assert "stopping" in str(failed[0])
