"""Unit tests open no sockets: no server, no channel, no TCP. What needs one is an integration test.
(An event loop's own socketpair, which binds and connects nothing, is allowed.)"""

from __future__ import annotations

import socket

import grpc
import grpc.aio
import pytest


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a unit test opened a socket or gRPC channel: move it to tests/integration")

    for module, name in (
        (socket.socket, "connect"),
        (socket.socket, "connect_ex"),
        (socket.socket, "bind"),
        (socket, "create_connection"),
        (grpc, "server"),
        (grpc, "insecure_channel"),
        (grpc, "secure_channel"),
        (grpc.aio, "server"),
        (grpc.aio, "insecure_channel"),
        (grpc.aio, "secure_channel"),
    ):
        monkeypatch.setattr(module, name, refuse)
