"""Shared fixtures: a real weight server on a free loopback port and clients bound to it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The layers (unit/, integration/, system/) share the helpers beside this file (pki, launch,
# waiting, torchrl_models), imported by name.
sys.path.insert(0, str(Path(__file__).parent))

from weightserver import ServerConfig, WeightServer

pytest_plugins = ["alone"]  # tests/alone.py: a test marked alone runs while no other does

# Ray rewrites a loopback address to the machine's outward one when a driver connects unless
# this is 0 (its switch for clusters on one machine). It is read when ray is first imported, and
# an integration test imports ray (through weightserver.relay.ray_relays) before the Ray tests
# run: so it is set here, before any test module. The raylets a cluster starts inherit it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture
def server() -> Iterator[WeightServer]:
    """An in-memory server on 127.0.0.1:<free port>, stopped after the test."""
    srv = WeightServer(ServerConfig(host="127.0.0.1", port=0)).start()
    try:
        yield srv
    finally:
        srv.stop(grace=0)


@pytest.fixture
def make_server() -> Iterator:
    """Factory for servers with custom settings: ``make_server(keep=2, data_dir=...)``."""
    started: list[WeightServer] = []

    def factory(**settings) -> WeightServer:
        settings.setdefault("host", "127.0.0.1")
        settings.setdefault("port", 0)
        srv = WeightServer(ServerConfig(**settings)).start()
        started.append(srv)
        return srv

    try:
        yield factory
    finally:
        for srv in started:
            srv.stop(grace=0)


@pytest.fixture
def client(server: WeightServer) -> Iterator:
    """A WeightClient connected to `server`."""
    from weightclient import WeightClient

    with WeightClient(server.address) as c:
        yield c


@pytest.fixture
def other_client(server: WeightServer) -> Iterator:
    """A second, independent WeightClient on `server` (to show others keep being served)."""
    from weightclient import WeightClient

    with WeightClient(server.address) as c:
        yield c


def pytest_configure(config: pytest.Config) -> None:
    # CI sets this so the torchrl tests can never pass by being skipped.
    import importlib.util
    import os

    if os.environ.get("WEIGHTSERVER_REQUIRE_TORCHRL") == "1" and importlib.util.find_spec("torchrl") is None:
        raise pytest.UsageError("WEIGHTSERVER_REQUIRE_TORCHRL=1 but torchrl is not installed")
