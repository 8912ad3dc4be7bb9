"""The C++ client (client/cpp) against a live server: build it with CMake, run its ctest suite.

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
from waiting import wait_until

from weightserver import WeightServer

ROOT = Path(__file__).resolve().parents[1]
CPP = ROOT / "client" / "cpp"
BUILD = CPP / "build"


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


def test_cpp_client_ctest(cpp_build: Path, server: WeightServer, tmp_path: Path) -> None:
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
    }
    expected_path = tmp_path / "expected.json"
    expected_path.write_text(json.dumps(expected))

    env = dict(os.environ, WEIGHTSERVER_ADDRESS=server.address, WEIGHTSERVER_EXPECTED_JSON=str(expected_path))
    result = subprocess.run(
        ["ctest", "--output-on-failure", "--timeout", "120"],
        cwd=cpp_build,
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-8000:]


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
