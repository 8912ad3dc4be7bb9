"""Bearer tokens with roles, TLS and mutual TLS, against real servers with throwaway
certificates made at run time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import make_pki

from weightclient import WeightClient
from weightclient.core.service_client import WeightServiceClient
from weightserver.protocol.errors import (
    AuthenticationRequired,
    DeadlineExceeded,
    InvalidRequest,
    PermissionDenied,
    ServerUnavailable,
)
from weightserver.service.auth import REQUIRED_ROLE, TokenTable
from weightserver.v1 import weights_pb2 as pb

MODEL = "policy"
# A failed handshake shows as UNAVAILABLE, or as DEADLINE_EXCEEDED where the peer waits for
# bytes that never come (plaintext to a TLS port).
REFUSED = (ServerUnavailable, DeadlineExceeded)
TOKENS = {"reader": "r" * 8 + "eader-token-1234", "publisher": "p" * 8 + "ublish-token-123", "admin": "a" * 24}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(
        "# role name token\n"
        + "\n".join(f"{role}  {role}-user  {token}  # {role}" for role, token in TOKENS.items())
        + "\n\n"
    )
    return path


@pytest.fixture
def auth_server(make_server, token_file):
    return make_server(auth_tokens=token_file)


def weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}


# ---------------------------------------------------------------------- tokens
def test_the_proto_names_the_call_metadata_and_environment_that_clients_use():
    """A client written from the proto alone learns there how to authenticate and name itself,
    and which environment variables the project's clients read: the names the server and the
    Python client actually use."""
    from weightclient.core import failover
    from weightserver.protocol.channel import AUTHORIZATION_METADATA_KEY
    from weightserver.protocol.errors import CLIENT_ID_METADATA_KEY, ERROR_METADATA_KEY

    proto = (Path(__file__).resolve().parents[2] / "protos/weightserver/v1/weights.proto").read_text()
    top = proto.split("syntax = ")[0]  # the file's top comment
    assert f"`{AUTHORIZATION_METADATA_KEY}: Bearer <token>`" in top
    assert f"`{CLIENT_ID_METADATA_KEY}: <name>`" in top
    assert f'"{ERROR_METADATA_KEY}"' in top
    assert failover.ADDRESS_ENV in top and failover.TOKEN_ENV in top
    tls = f"{failover.TLS_CA_ENV}, _CERT, _KEY"  # as the proto shortens the three names
    assert tls in top and {failover.TLS_CERT_ENV, failover.TLS_KEY_ENV} == {
        failover.TLS_CA_ENV.replace("_CA", suffix) for suffix in ("_CERT", "_KEY")
    }


def test_every_rpc_of_the_proto_has_a_required_role():
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["WeightService"].methods}
    assert set(REQUIRED_ROLE) == methods


def test_roles_allow_exactly_their_calls(auth_server):
    clients = {role: WeightClient(auth_server.address, token=token) for role, token in TOKENS.items()}
    try:
        with pytest.raises(PermissionDenied, match=r"Publish needs the 'publisher' role.*'reader-user' has 'reader'"):
            clients["reader"].publish(weights(), model=MODEL)
        v1 = clients["publisher"].publish(weights(), model=MODEL)
        v2 = clients["admin"].publish(weights(), model=MODEL)
        for role, client in clients.items():
            assert client.latest(MODEL).version == v2, role
            assert torch.equal(client.fetch(MODEL).tensors["w"], weights()["w"]), role
            assert [v.version for v in client.list_versions(MODEL)] == [v1, v2]
            assert [m.model for m in client.list_models()] == [MODEL]
            assert next(iter(client.watch(MODEL, since=v1, timeout=5))).version == v2
        for role in ("reader", "publisher"):
            with pytest.raises(PermissionDenied, match="needs the 'admin' role"):
                clients[role].pin(MODEL, v1)
            with pytest.raises(PermissionDenied, match="needs the 'admin' role"):
                clients[role].delete(MODEL, v1)
        assert clients["admin"].pin(MODEL, v1).pinned
        assert clients["admin"].delete(MODEL, v1).version == v1
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("token", [None, "not-a-known-token-at-all", ""])
def test_missing_or_unknown_token_is_unauthenticated(auth_server, token, monkeypatch):
    monkeypatch.delenv("WEIGHTSERVER_TOKEN", raising=False)
    with WeightClient(TOKENS["publisher"] and auth_server.address, token=TOKENS["publisher"]) as good:
        good.publish(weights(), model=MODEL)
    with WeightClient(auth_server.address, token=token) as client:
        for call in (
            lambda: client.latest(MODEL),
            lambda: client.fetch(MODEL),
            lambda: client.publish(weights(), model=MODEL),
            lambda: next(iter(client.watch(MODEL, timeout=5))),
        ):
            with pytest.raises(AuthenticationRequired, match="token"):
                call()


def test_malformed_authorization_header_is_unauthenticated(auth_server):
    with grpc.insecure_channel(auth_server.address) as channel:
        stub = channel.unary_unary(
            "/weightserver.v1.WeightService/ListModels",
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        for header in ("Basic abc", "Bearer", TOKENS["admin"]):
            with pytest.raises(grpc.RpcError) as caught:
                stub(pb.ListModelsRequest(), metadata=(("authorization", header),), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer <token>" in caught.value.details()
        reply = stub(pb.ListModelsRequest(), metadata=(("authorization", f"Bearer {TOKENS['reader']}"),), timeout=5)
        assert list(reply.models) == []


def test_token_comes_from_the_environment(auth_server, monkeypatch):
    monkeypatch.setenv("WEIGHTSERVER_TOKEN", TOKENS["publisher"])
    with WeightClient(auth_server.address) as client:
        assert client.publish(weights(), model=MODEL) == 1


def test_health_and_reflection_need_no_token(auth_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(auth_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in next(replies).list_services_response.service}
    assert "weightserver.v1.WeightService" in names


def test_tokens_are_never_logged(make_server, token_file, caplog):
    caplog.set_level("DEBUG")
    server = make_server(auth_tokens=token_file)
    with WeightClient(server.address, token=TOKENS["admin"]) as client:
        version = client.publish(weights(), model=MODEL)
        client.fetch(MODEL, transport="stream")
        client.delete(MODEL, version)
    with (
        WeightClient(server.address, token="wrong-token-but-long-enough") as client,
        pytest.raises(AuthenticationRequired),
    ):
        client.latest(MODEL)
    text = caplog.text
    assert "publish" in text.lower()  # the server did log the calls
    assert all(token not in text for token in TOKENS.values())
    assert "wrong-token-but-long-enough" not in text


def test_shared_memory_files_are_private_to_the_server_user_with_auth(auth_server):
    assert auth_server.shared_memory is not None
    assert auth_server.shared_memory.directory.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("reader only-two-fields\n", "expected 'ROLE NAME TOKEN'"),
        ("owner x " + "t" * 20 + "\n", "unknown role 'owner'"),
        ("reader x short\n", "shorter than 16"),
        ("reader a " + "t" * 20 + "\nadmin b " + "t" * 20 + "\n", "repeats another entry's token"),
        ("# nothing\n", "lists no tokens"),
    ],
)
def test_bad_token_files_are_refused_with_the_line_and_never_the_token(tmp_path, content, message):
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match=message) as caught:
        TokenTable.load(path)
    assert "t" * 20 not in str(caught.value)


def test_serve_refuses_a_bad_token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("reader x short\n")
    done = subprocess.run(
        [sys.executable, "-m", "weightserver", "serve", "--port", "0", "--auth-tokens", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "shorter than 16" in done.stderr


def test_token_lookup_compares_every_entry(tmp_path):
    """Constant time: the lookup touches every entry whether the token is first, last or absent."""
    table = TokenTable([("reader", f"n{i}", f"token-number-{i:08d}") for i in range(200)])
    assert table.identify("token-number-00000000").name == "n0"
    assert table.identify("token-number-00000199").name == "n199"
    assert table.identify("token-number-99999999") is None
    timings = {}
    for label, token in (("first", "token-number-00000000"), ("absent", "x" * 21)):
        start = time.perf_counter()
        for _ in range(200):
            table.identify(token)
        timings[label] = time.perf_counter() - start
    # Same work either way (an early exit would make "first" ~200x faster); generous bound.
    assert timings["first"] > timings["absent"] / 5


# ---------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_round_trip_and_plaintext_is_refused(make_server, pki):
    server = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    assert server.bulk is None  # plain TCP would bypass TLS
    with WeightClient(server.address, tls_ca=pki["ca"]) as client:
        version = client.publish(weights(), model=MODEL)
        result = client.fetch(MODEL, transport="auto")
        assert result.version == version and torch.equal(result.tensors["w"], weights()["w"])
        assert result.stats.transport in ("stream", "shm")
        bulk = client.fetch(MODEL, transport="bulk")  # asked for, not offered: the TLS stream
        assert bulk.stats.transport == "stream"
    with WeightClient(server.address, timeout=2) as plaintext, pytest.raises(REFUSED):
        plaintext.latest(MODEL)
    with (
        WeightClient(server.address, tls_ca=pki["other_ca"], timeout=2) as wrong_ca,
        pytest.raises(REFUSED),
    ):
        wrong_ca.latest(MODEL)


def test_tls_settings_from_the_environment(make_server, pki, monkeypatch):
    server = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    monkeypatch.setenv("WEIGHTSERVER_TLS_CA", str(pki["ca"]))
    with WeightServiceClient(server.address) as client:
        assert client.list_models() == []


def test_mutual_tls_needs_a_client_certificate_from_the_ca(make_server, pki, token_file):
    server = make_server(
        tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"], auth_tokens=token_file
    )
    with WeightClient(
        server.address,
        tls_ca=pki["ca"],
        tls_cert=pki["client_cert"],
        tls_key=pki["client_key"],
        token=TOKENS["publisher"],
    ) as client:
        assert client.publish(weights(), model=MODEL) == 1
        assert client.fetch(MODEL).version == 1
    for extra in ({}, {"tls_cert": pki["stranger_cert"], "tls_key": pki["stranger_key"]}):
        with (
            WeightClient(server.address, tls_ca=pki["ca"], token=TOKENS["admin"], timeout=2, **extra) as client,
            pytest.raises(REFUSED),
        ):
            client.latest(MODEL)


def test_cli_talks_tls_with_a_token_file(make_server, pki, token_file, tmp_path):
    server = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"], auth_tokens=token_file)
    with WeightClient(server.address, tls_ca=pki["ca"], token=TOKENS["publisher"]) as client:
        client.publish(weights(), model=MODEL)
    token = tmp_path / "token"
    token.write_text(TOKENS["reader"] + "\n")
    base = [sys.executable, "-m", "weightserver", "ls", "--server", server.address, "--tls-ca", str(pki["ca"])]
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSERVER_TOKEN"}
    ok = subprocess.run([*base, "--token-file", str(token)], capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0, ok.stderr
    assert MODEL in ok.stdout
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0
    assert "token" in refused.stderr


def test_server_config_rejects_half_a_tls_setup(pki):
    from weightserver import ServerConfig

    with pytest.raises(ValueError, match="go together"):
        ServerConfig(tls_cert=pki["server_cert"])
    with pytest.raises(ValueError, match="needs tls_cert"):
        ServerConfig(tls_client_ca=pki["ca"])


@pytest.mark.parametrize("broken", ["not a PEM file", "a key that is not the certificate's"])
def test_serve_names_tls_files_grpc_cannot_use(pki, tmp_path, broken):
    """A certificate and key gRPC cannot serve with fail the bind: the message names them. Before,
    gRPC's RuntimeError escaped as a traceback (and then the bind's message asked only whether the
    port was in use)."""
    cert, key = pki["server_cert"], pki["client_key"]
    if broken == "not a PEM file":
        cert = key = tmp_path / "garbage.pem"
        cert.write_text("garbage\n")
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    done = subprocess.run(
        [sys.executable, "-m", "weightserver", "serve", "--host", "127.0.0.1", "--port", "0", "--no-shm", *tls],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--tls-cert and --tls-key" in done.stderr
