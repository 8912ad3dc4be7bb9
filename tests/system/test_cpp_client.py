"""The C++ client (client/cpp) against live servers: build it with CMake, run its ctest suite
(one case per section of the expected file: basic, environment, token, tls, mtls; the file's
format is in client/cpp/README.md, "Tests").

Skipped when cmake, Debian's protoc / grpc_cpp_plugin or libgrpc++ are missing, unless
WEIGHTSERVER_REQUIRE_TOOLCHAINS=1 (CI), which turns a missing toolchain into a failure.
The build directory (client/cpp/build, git-ignored) is reused between runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from pki import make_pki
from waiting import wait_until

from weightserver import WeightServer

ROOT = Path(__file__).resolve().parents[2]
CPP = ROOT / "client" / "cpp"
BUILD = CPP / "build"
READER_TOKEN = "r" * 8 + "eader-token-1234"
PUBLISHER_TOKEN = "p" * 8 + "ublish-token-123"
CTEST_CASES = {"client_basic", "client_environment", "client_token", "client_tls", "client_mtls"}


def _published(address: str, model: str, weights: dict[str, torch.Tensor], **connection) -> dict:
    """Publish `weights` and describe the version as the expected file does (its sha256 once the
    server has computed it: the Python client declares only an xxh3)."""
    from weightclient import WeightClient

    with WeightClient(address, **connection) as client:
        version = client.publish(weights, model=model)
        wait_until(lambda: client.describe(model, version).sha256 != "")
        info = client.describe(model, version)
    return {"address": address, "model": model, "version": version, "sha256": info.sha256}


def _secured_servers(make_server, tmp_path: Path) -> dict:
    """The expected file's "token", "tls" and "mtls" entries, each with a server of its own."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"reader cpp-reader {READER_TOKEN}\npublisher cpp-publisher {PUBLISHER_TOKEN}\n")
    pki = make_pki(tmp_path)
    token_server = make_server(auth_tokens=tokens)
    tls_server = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    mtls_server = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    weights = {"w": torch.tensor([1.0, 2.0, 3.0])}
    client_files = {"tls_cert": pki["client_cert"], "tls_key": pki["client_key"]}
    return {
        "token": {
            **_published(token_server.address, "policy", weights, token=PUBLISHER_TOKEN),
            "token": READER_TOKEN,
        },
        "tls": {**_published(tls_server.address, "policy", weights, tls_ca=pki["ca"]), "ca": str(pki["ca"])},
        "mtls": {
            **_published(mtls_server.address, "policy", weights, tls_ca=pki["ca"], **client_files),
            "ca": str(pki["ca"]),
            "cert": str(pki["client_cert"]),
            "key": str(pki["client_key"]),
        },
    }


def _missing_toolchain() -> str | None:
    for tool in ("cmake", "protoc", "grpc_cpp_plugin", "pkg-config"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not Path("/usr/include/grpcpp/grpcpp.h").exists() and (
        subprocess.run(["pkg-config", "--exists", "grpc++"], check=False).returncode != 0
    ):
        return "libgrpc++-dev not installed"
    for header in ("/usr/include/nlohmann/json.hpp", "/usr/include/openssl/evp.h"):
        if not Path(header).exists():
            return f"{header} not found (nlohmann-json3-dev / libssl-dev)"
    return None


@pytest.fixture(scope="module")
def cpp_build() -> Path:
    missing = _missing_toolchain()
    if missing:
        message = f"C++ toolchain unavailable: {missing}"
        if os.environ.get("WEIGHTSERVER_REQUIRE_TOOLCHAINS") == "1":
            pytest.fail(f"{message} (WEIGHTSERVER_REQUIRE_TOOLCHAINS=1)")
        pytest.skip(message)
    subprocess.run(
        ["cmake", "-S", str(CPP), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release"],
        check=True,
        capture_output=True,
        text=True,
    )
    jobs = str(max(1, os.cpu_count() or 1))
    build = subprocess.run(["cmake", "--build", str(BUILD), "-j", jobs], check=False, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-8000:] + build.stderr[-8000:]
    return BUILD


def test_cpp_client_ctest(cpp_build: Path, server: WeightServer, make_server, tmp_path: Path) -> None:
    from weightclient import WeightClient

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    steps = torch.arange(5, dtype=torch.int64)
    big_numel = 1_200_000  # 4.8 MB of F32: several 1 MiB chunks
    with WeightClient(server.address) as client:
        client.publish({"w": w, "steps": steps}, model="policy", metadata={"step": "7"})
        version = client.publish({"w": w + 1, "steps": steps * 2}, model="policy", metadata={"step": "7"})
        client.publish({"big": torch.arange(big_numel, dtype=torch.float32)}, model="big")
        # The sha256s the server computes after the commits (the Python client declares xxh3).
        wait_until(lambda: client.latest("policy").sha256 != "" and client.latest("big").sha256 != "")
        info = client.latest("policy")
        big = client.latest("big")
    assert info.version == version == 2
    assert big.byte_size > 3 * 1024 * 1024

    expected = {
        "model": "policy",
        "version": version,
        "sha256": info.sha256,
        "step": "7",
        "w": (w + 1).flatten().tolist(),
        "steps": (steps * 2).tolist(),
        "big_model": "big",
        "big_sha256": big.sha256,
        "big_size": big.byte_size,
        "big_numel": big_numel,
        **_secured_servers(make_server, tmp_path),
    }
    expected_path = tmp_path / "expected.json"
    expected_path.write_text(json.dumps(expected))

    # The client's defaults come from the environment: none leak in from the caller's.
    env = {name: value for name, value in os.environ.items() if not name.startswith("WEIGHTSERVER_")}
    env.update(WEIGHTSERVER_ADDRESS=server.address, WEIGHTSERVER_EXPECTED_JSON=str(expected_path))
    result = subprocess.run(
        ["ctest", "--output-on-failure", "--timeout", "120"],
        cwd=cpp_build,
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-8000:]
    passed = {line.split()[3] for line in result.stdout.splitlines() if " Passed " in line and "Test #" in line}
    assert passed == CTEST_CASES, result.stdout[-8000:]


def test_cpp_cli_writes_verified_file(cpp_build: Path, server: WeightServer, tmp_path: Path) -> None:
    import hashlib

    from weightclient import WeightClient

    with WeightClient(server.address) as client:
        version = client.publish({"w": torch.ones(4, 4)}, model="policy", metadata={"step": "1"})
        wait_until(lambda: client.latest("policy").sha256 != "")  # computed after the commit
        info = client.latest("policy")
    out = tmp_path / "policy.safetensors"
    result = subprocess.run(
        [
            str(cpp_build / "weightserver-fetch"),
            "--server",
            server.address,
            "--model",
            "policy",
            "--version",
            str(version),
            "-o",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() == info.sha256
    assert f"version {version}" in result.stdout
    assert info.sha256 in result.stdout
