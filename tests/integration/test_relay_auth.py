"""A relay of an upstream that requires a token, TLS or mutual TLS (`weightserver serve
--upstream ... --upstream-token-file / $WEIGHTSERVER_UPSTREAM_TOKEN, --upstream-tls-ca,
--upstream-tls-cert, --upstream-tls-key`): real servers on loopback ports, throwaway
certificates made at run time. The relay holds the primary's versions byte for byte, receives
publishes as they arrive (cut-through) through the same credentials, follows a relay that
requires them too; refused, it says so in its health, metrics and log, serves nothing it never
received, backs off, and follows once the upstream accepts it."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import make_pki
from waiting import wait_for, wait_until

from tests.integration.test_cut_through import EarlyReceive, HeldPublish, Watcher, file_of, weights_filled
from tests.integration.test_relay import held, weights
from weightclient import ModelNotFound, NotPrimary, WeightClient, WeightServiceClient
from weightserver.cli import build_parser, server_config
from weightserver.config import ServerConfig
from weightserver.process import ServerProcess
from weightserver.protocol.errors import AuthenticationRequired
from weightserver.protocol.version_info import IncomingEvent, VersionEvent
from weightserver.relay.relay import RELAY_HEALTH_SERVICE
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

MODEL = "policy"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TOKENS = {
    "trainer": "publisher-token-0123456789",
    "relay": "relay-reader-token-0123456",
    "leaf": "leaf-reader-token-01234567",
    "collector": "collector-token-0123456789",
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def token_file(path: Path, **roles: str) -> Path:
    """A --auth-tokens file: `name=role` for each token of TOKENS it lists."""
    path.write_text("".join(f"{role} {name} {TOKENS[name]}\n" for name, role in roles.items()))
    return path


@dataclass(frozen=True)
class Dial:
    """How a test dials a server: plaintext or TLS (a CA, a client certificate), with a token or none."""

    address: str
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def client(self, **options) -> WeightClient:
        tls = {"tls_ca": self.tls_ca, "tls_cert": self.tls_cert, "tls_key": self.tls_key}
        return WeightClient(self.address, token=self.token, **tls, **options)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls_ca is None:
            return None
        key = self.tls_key.read_bytes() if self.tls_key else None
        cert = self.tls_cert.read_bytes() if self.tls_cert else None
        return grpc.ssl_channel_credentials(self.tls_ca.read_bytes(), key, cert)

    def channel(self) -> grpc.Channel:
        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, credentials)

    def describe(self, version: int) -> pb.VersionInfo:
        """The server's description of `version` as the proto carries it (every field), once it has
        the sha256 it computes after the commit ("" until then; a relay may get there first)."""
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else None
        request = pb.DescribeRequest(model=MODEL, version=version)

        def described() -> pb.VersionInfo:
            with self.channel() as channel:
                return pb_grpc.WeightServiceStub(channel).Describe(request, timeout=5, metadata=metadata)

        return wait_for(described, lambda info: info.sha256 != "", what=f"the sha256 of v{version} on {self.address}")

    def fetched(self, version: int) -> bytes:
        with self.client() as client:
            return bytes(client.fetch_bytes(MODEL, version=version, transport="stream").data)

    def versions(self) -> list[int]:
        with self.client() as client:
            return [v.version for v in client.list_versions(MODEL)]

    def health(self, service: str) -> int:
        with self.channel() as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def assert_same_versions(relay: Dial, primary: Dial, versions: list[int]) -> None:
    """The relay holds exactly `versions`, each described and fetched as the primary does."""
    assert relay.versions() == versions
    for version in versions:
        assert relay.describe(version) == primary.describe(version)
        assert relay.fetched(version) == primary.fetched(version)


def latest(client: WeightClient) -> int:
    try:
        return client.latest(MODEL, retry=False).version
    except ModelNotFound:
        return 0


def sample(server, name: str) -> float | None:
    return server.metrics.registry.get_sample_value(name, {})


def refusals_logged(caplog) -> list[logging.LogRecord]:
    """The relay's log records saying that its upstream refuses it."""
    return [r for r in caplog.records if "refuses this relay" in r.getMessage()]


# ---------------------------------------------------------------------- following
def test_a_relay_follows_a_primary_with_a_token_and_mutual_tls_byte_for_byte_and_early(
    make_server, pki, tmp_path, monkeypatch
):
    """The relay is a `weightserver serve` process given its token in $WEIGHTSERVER_UPSTREAM_TOKEN
    and its client certificate on the command line; a follower on it receives a publish's bytes
    before the primary commits it, so the relay's cut-through receive carried them too."""
    tokens = token_file(tmp_path / "tokens", trainer="publisher", relay="reader")
    primary = make_server(
        tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"], auth_tokens=tokens
    )
    mutual = {"tls_ca": pki["ca"], "tls_cert": pki["client_cert"], "tls_key": pki["client_key"]}
    at_primary = Dial(primary.address, TOKENS["trainer"], **mutual)
    monkeypatch.setenv("WEIGHTSERVER_UPSTREAM_TOKEN", TOKENS["relay"])
    tls_options = [f"--upstream-tls-{name}={mutual[f'tls_{name}']}" for name in ("ca", "cert", "key")]
    with (
        at_primary.client() as trainer,
        ServerProcess("--upstream", primary.address, "--upstream-poll", "0.1", *tls_options) as relay,
    ):
        assert "TLS, with a token" in relay.log()
        trainer.publish(weights(0), MODEL, metadata={"step": "0"})
        trainer.publish(weights(1), MODEL, version=7, metadata={"step": "1", "run": "a"})
        wait_until(lambda: held(relay.address, MODEL) == 7, timeout=15)
        with WeightClient(relay.address) as collector:
            watcher = Watcher.subscribed(collector, held=7)
            data = file_of(weights_filled(2.5))
            publish = HeldPublish(
                primary.address, data, "stream", credentials=at_primary.credentials(), token=TOKENS["trainer"]
            )
            announced = watcher.next()
            assert isinstance(announced, IncomingEvent) and announced.byte_size == len(data)
            receive = EarlyReceive(collector, announced, "bulk")
            wait_until(lambda: receive.received >= 1 << 20, timeout=10)
            assert receive.received < len(data) and held(primary, MODEL) == 7
            version = publish.finish()
            committed = watcher.next()
            assert isinstance(committed, VersionEvent) and committed.version == version == 8
            assert committed.incoming == announced.id  # the relay committed the bytes it received early
            early = receive.join()
            assert not isinstance(early, Exception), early
            assert bytes(early.data) == data
        wait_until(lambda: held(relay.address, MODEL) == 8, timeout=10)
        assert_same_versions(Dial(relay.address), at_primary, [1, 7, 8])
        assert Dial(relay.address).describe(7).metadata == {"step": "1", "run": "a"}
        assert Dial(relay.address).health(RELAY_HEALTH_SERVICE) == SERVING
        assert TOKENS["relay"] not in relay.log()


def test_a_relay_of_a_relay_where_every_hop_needs_a_token_and_two_need_tls(make_server, pki, tmp_path):
    """primary (TLS, tokens) <- middle (TLS, tokens, in this process) <- leaf (plaintext, tokens,
    a `weightserver serve` process) <- a collector with its token."""
    primary = make_server(
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        auth_tokens=token_file(tmp_path / "primary-tokens", trainer="publisher", relay="reader"),
    )
    middle = make_server(
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        auth_tokens=token_file(tmp_path / "middle-tokens", leaf="reader"),
        upstream=primary.address,
        upstream_poll_seconds=0.1,
        upstream_token=TOKENS["relay"],
        upstream_tls_ca=pki["ca"],
    )
    (tmp_path / "leaf-token").write_text(TOKENS["leaf"] + "\n")
    leaf_args = [
        *("--upstream", middle.address, "--upstream-poll", "0.1", "--upstream-tls-ca", str(pki["ca"])),
        *("--upstream-token-file", str(tmp_path / "leaf-token")),
        *("--auth-tokens", str(token_file(tmp_path / "leaf-tokens", collector="publisher"))),
    ]
    at_primary = Dial(primary.address, TOKENS["trainer"], tls_ca=pki["ca"])
    with at_primary.client() as trainer, ServerProcess(*leaf_args) as leaf:
        at_leaf = Dial(leaf.address, TOKENS["collector"])
        trainer.publish(weights(1), MODEL, metadata={"step": "1"})
        trainer.publish(weights(2), MODEL, metadata={"step": "2"})
        wait_until(lambda: held(middle, MODEL) == 2, timeout=15)
        with at_leaf.client() as collector:
            wait_until(lambda: latest(collector) == 2, timeout=15)
            assert_same_versions(at_leaf, at_primary, [1, 2])
            with pytest.raises(NotPrimary) as refused:  # past its token check; the primary named through two hops
                collector.publish(weights(9), MODEL)
            assert str(refused.value).endswith(f"to the primary, {primary.address}")
        assert Dial(middle.address, tls_ca=pki["ca"]).health(RELAY_HEALTH_SERVICE) == SERVING
        assert at_leaf.health(RELAY_HEALTH_SERVICE) == SERVING
        with WeightClient(leaf.address, token="", retry_seconds=0) as anonymous, pytest.raises(AuthenticationRequired):
            anonymous.latest(MODEL)  # the leaf's own tokens guard it


# ---------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    ("relay_token", "advice"),
    [(None, "it requires a token: give the relay one"), ("wrong-token-but-long-enough", "check the token")],
)
def test_a_refused_relay_says_so_serves_nothing_it_never_received_backs_off_and_follows_once_accepted(
    make_server, tmp_path, caplog, relay_token, advice
):
    caplog.set_level(logging.WARNING)
    tokens = token_file(tmp_path / "tokens", trainer="publisher")  # the relay's token is not listed
    primary = ServerProcess("--auth-tokens", str(tokens), "--data-dir", str(tmp_path / "data")).start()
    try:
        with Dial(primary.address, TOKENS["trainer"]).client() as trainer:
            trainer.publish(weights(1), MODEL)
        relay = make_server(
            upstream=primary.address,
            upstream_poll_seconds=0.1,
            upstream_models=(MODEL,),  # a follower Watches too, besides the poll
            upstream_token=relay_token,
            metrics_port=0,
        )
        # The refusal is logged last in the relay's report (before its health, which says
        # NOT_SERVING from the start): once it is, the metrics and the error are in place.
        wait_until(lambda: refusals_logged(caplog), what="the relay's refusal logged")
        at_relay = Dial(relay.address)
        assert at_relay.health(RELAY_HEALTH_SERVICE) == NOT_SERVING
        assert at_relay.health("") == SERVING  # it still serves what it holds
        assert sample(relay, "weightserver_relay_upstream_up") == 0
        assert sample(relay, "weightserver_relay_upstream_refused") == 1
        assert relay.relay.upstream_error.startswith("AuthenticationRequired: ")
        # It backs off: a few refused calls a second at first, then fewer; not a hot loop (the
        # poll alone, every 0.1 s, would make 30 in the window).
        time.sleep(2.0)
        before = sample(relay, "weightserver_relay_upstream_refusals_total")
        time.sleep(3.0)
        assert sample(relay, "weightserver_relay_upstream_refusals_total") - before <= 12
        # One error, naming the cause and what to set; the token itself never logged.
        refusals = refusals_logged(caplog)
        assert [r.levelno for r in refusals] == [logging.ERROR]
        errors = [r.getMessage() for r in refusals]
        assert (
            "AuthenticationRequired" in errors[0] and advice in errors[0] and "WEIGHTSERVER_UPSTREAM_TOKEN" in errors[0]
        )
        assert relay_token is None or relay_token not in caplog.text
        # It serves nothing it never received.
        with WeightServiceClient(relay.address, retry_seconds=0) as collector:
            assert collector.list_models() == []
            with pytest.raises(ModelNotFound):
                collector.latest(MODEL)
        assert relay.relay.upstream_latest == {}

        # The upstream comes back accepting the relay's token: the relay follows, unrestarted.
        primary.stop()
        if relay_token is not None:
            TOKENS_NOW = {**TOKENS, "relay": relay_token}
            tokens.write_text(
                "".join(f"{r} {n} {TOKENS_NOW[n]}\n" for n, r in (("trainer", "publisher"), ("relay", "reader")))
            )
        else:
            tokens.unlink()
            primary.args = ["--data-dir", str(tmp_path / "data")]  # no tokens at all now
        primary.start()
        wait_until(lambda: held(relay, MODEL) == 1, timeout=20)
        wait_until(lambda: at_relay.health(RELAY_HEALTH_SERVICE) == SERVING, timeout=10)
        assert sample(relay, "weightserver_relay_upstream_up") == 1
        assert sample(relay, "weightserver_relay_upstream_refused") == 0
        assert relay.relay.upstream_error is None
        assert_same_versions(at_relay, Dial(primary.address, TOKENS["trainer"]), [1])
    finally:
        primary.stop()


@pytest.mark.parametrize("mismatch", ["another CA", "no client certificate", "plaintext"])
def test_a_relay_whose_tls_handshake_fails_reports_the_upstream_away_and_what_to_check(
    make_server, pki, tmp_path, caplog, mismatch
):
    caplog.set_level(logging.WARNING)
    primary = make_server(
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        tls_client_ca=pki["ca"] if mismatch == "no client certificate" else None,
    )
    with Dial(
        primary.address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]
    ).client() as trainer:
        trainer.publish(weights(1), MODEL)
    link = {
        "another CA": {"upstream_tls_ca": pki["other_ca"]},
        "no client certificate": {"upstream_tls_ca": pki["ca"]},
        "plaintext": {},
    }[mismatch]
    relay = make_server(upstream=primary.address, upstream_poll_seconds=0.1, metrics_port=0, **link)
    # The warning is the last thing the relay's report does before its health (NOT_SERVING
    # from the start): wait for what is asserted, not for the flag set before it.
    warnings = wait_for(
        lambda: [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()],
        timeout=15,
        what="the relay's warning that its upstream does not answer",
    )
    assert relay.relay.upstream_up is False
    assert Dial(relay.address).health(RELAY_HEALTH_SERVICE) == NOT_SERVING
    assert not relay.relay.upstream_refused and sample(relay, "weightserver_relay_upstream_refused") == 0
    check = "--upstream-tls-cert" if mismatch == "no client certificate" else "--upstream-tls-ca"
    assert check in warnings[0]
    time.sleep(1.0)
    assert held(relay, MODEL) == 0 and relay.relay.upstream_up is False


# ---------------------------------------------------------------------- the command line
def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "weightserver", "serve", "--port", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--upstream-tls-cert", "{client_cert}"], "upstream_tls_cert without upstream_tls_key"),
        (["--upstream-tls-key", "{client_key}"], "upstream_tls_key without upstream_tls_cert"),
        (["--upstream-tls-ca", "{tmp}/missing.pem"], "cannot read the upstream's TLS file"),
        (["--upstream-tls-ca", "{tmp}/token"], "--upstream-tls-ca '{tmp}/token' is not a PEM file"),
        (["--upstream-token-file", "{tmp}/missing"], "--upstream-token-file {tmp}/missing: No such file"),
        (["--upstream-token-file", "{tmp}/empty"], "is empty: give the token itself"),
        (["--upstream-token-file", "{tmp}/spaced"], "one word of printable ASCII"),
    ],
)
def test_serve_refuses_an_upstream_link_it_cannot_use_and_says_what_to_do(pki, tmp_path, args, message):
    (tmp_path / "token").write_text(TOKENS["relay"])
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "spaced").write_text("two words-of-a-token\n")
    names = {"tmp": tmp_path, **pki}
    done = serve("--upstream", "127.0.0.1:1", *(arg.format(**names) for arg in args))
    assert done.returncode == 1, done.stderr
    assert message.format(**names) in done.stderr
    assert TOKENS["relay"] not in done.stderr


def test_upstream_link_options_need_an_upstream_and_the_token_is_never_shown(pki, tmp_path):
    (tmp_path / "token").write_text(TOKENS["relay"])
    for args in (["--upstream-token-file", str(tmp_path / "token")], ["--upstream-tls-ca", str(pki["ca"])]):
        done = serve(*args)
        assert done.returncode == 1 and "give upstream (--upstream ADDRESS) too" in done.stderr
    parser = build_parser()
    # $WEIGHTSERVER_UPSTREAM_TOKEN is a relay's: a primary ignores it (it may be set for another program).
    environ = {"WEIGHTSERVER_UPSTREAM_TOKEN": TOKENS["relay"]}
    assert server_config(parser.parse_args(["serve"]), environ).upstream_token is None
    relay = server_config(parser.parse_args(["serve", "--upstream", "primary:50051"]), environ)
    assert relay.upstream_token == TOKENS["relay"] and not relay.upstream_uses_tls
    from_file = parser.parse_args(["serve", "--upstream", "p:1", "--upstream-token-file", str(tmp_path / "token")])
    assert (
        server_config(from_file, {"WEIGHTSERVER_UPSTREAM_TOKEN": "another-token-xxxxxxxx"}).upstream_token
        == (TOKENS["relay"])
    )  # the file wins
    assert TOKENS["relay"] not in repr(relay)
    assert ServerConfig(upstream="p:1", upstream_tls=True).upstream_uses_tls
    shown = serve("--help").stdout
    for option in (
        "--upstream-token-file FILE",
        "--upstream-tls-ca PEM",
        "--upstream-tls-cert PEM",
        "--upstream-tls-key PEM",
    ):
        assert option in shown
    assert "WEIGHTSERVER_UPSTREAM_TOKEN" in shown
