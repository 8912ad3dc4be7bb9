"""`ServerProcess` starts a `weightserver serve` that serves TLS (or mutual TLS): `start()`
checks its health with the credentials it was given, and a server that serves TLS only is
refused up front when none are, instead of waiting out the start timeout over plaintext."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import grpc
import pytest
from pki import make_pki
from waiting import wait_until

from weightclient import ModelNotFound, WeightClient
from weightserver.process import ServerProcess
from weightserver.protocol.channel import channel_credentials
from weightserver.relay.ray_relays import RelayServer, RelayTLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _round_trip(server: ServerProcess, **tls: Path) -> None:
    with WeightClient(server.address, **tls) as client:
        version = client.publish_bytes("policy", struct.pack("<Q", 8) + b"{}      ", transport="stream").version
        assert client.latest("policy").version == version == 1


def test_a_tls_server_process_starts_and_serves_over_tls(pki) -> None:
    tls_args = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    with ServerProcess(*tls_args, credentials=channel_credentials(tls_ca=pki["ca"])) as server:
        _round_trip(server, tls_ca=pki["ca"])


def test_a_mutual_tls_server_process_is_checked_with_a_client_certificate(pki) -> None:
    args = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    args += ["--tls-client-ca", str(pki["ca"])]
    mine = {"tls_ca": pki["ca"], "tls_cert": pki["client_cert"], "tls_key": pki["client_key"]}
    with ServerProcess(*args, credentials=channel_credentials(**mine)) as server:
        _round_trip(server, **mine)


def test_a_tls_server_process_without_credentials_is_refused_at_once(pki) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"--tls-cert serves TLS only.*credentials="):
        ServerProcess(f"--tls-cert={pki['server_cert']}", "--tls-key", str(pki["server_key"]))
    assert time.monotonic() - started < 1


def test_a_failed_health_check_leaves_no_server_behind(pki) -> None:
    """Credentials the server refuses (a client certificate from another CA): start() raises
    once its deadline has passed, and the child it started is gone."""
    args = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    args += ["--tls-client-ca", str(pki["ca"])]
    stranger = channel_credentials(tls_ca=pki["ca"], tls_cert=pki["stranger_cert"], tls_key=pki["stranger_key"])
    server = ServerProcess(*args, credentials=stranger)
    with pytest.raises(grpc.RpcError):
        server.start(timeout=3)
    assert server.process is not None and server.process.poll() is not None


def _held(client: WeightClient) -> list[int]:
    try:
        return [v.version for v in client.list_versions("policy")]
    except ModelNotFound:
        return []


def test_a_relay_that_serves_tls_starts_checked_with_its_tls(pki) -> None:
    """`RelayServer`, the body of `place_relays`' Ray actors (plain Python, so no Ray here): a
    relay given --tls-cert among its args serves its followers over TLS only."""
    data = struct.pack("<Q", 8) + b"{}      "
    tls_args = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    with ServerProcess() as primary, WeightClient(primary.address) as trainer:
        trainer.publish_bytes("policy", data, transport="stream")
        relay = RelayServer(primary.address, tls_args, timeout=30, tls=RelayTLS(ca=str(pki["ca"])))
        try:
            with WeightClient(relay.address(), tls_ca=pki["ca"]) as follower:
                wait_until(lambda: _held(follower) == [1], timeout=10)
                assert bytes(follower.fetch_bytes("policy", version=1, transport="stream").data) == data
        finally:
            assert relay.stop() == 0
    with pytest.raises(ValueError, match="--tls-cert serves TLS only"):
        RelayServer(primary.address, tls_args, timeout=30)
