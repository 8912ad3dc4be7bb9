"""The Node.js client (client/node) against a live Python server.

Python starts real servers (one plain, one requiring tokens), publishes weights with the Python
client (F32, I64, BOOL, BF16, F16 and a multi-chunk model over 3 MiB), writes what it published
to a JSON file and runs ``node --test`` in client/node, which fetches, watches and compares. A
background thread keeps publishing a "watched" model so node's watch sees new versions.

Skipped when node/npm are missing, unless WEIGHTSERVER_REQUIRE_TOOLCHAINS=1 (CI).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from pki import make_pki
from waiting import wait_until

from weightclient import WeightClient

NODE_DIR = Path(__file__).resolve().parents[2] / "client" / "node"
TOKEN = "r" * 8 + "eader-token-1234"
PUBLISH_TOKEN = "p" * 8 + "ublish-token-123"


def _require_toolchain() -> tuple[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node and npm:
        return node, npm
    message = "node and npm are needed for the Node.js client tests"
    if os.environ.get("WEIGHTSERVER_REQUIRE_TOOLCHAINS") == "1":
        pytest.fail(f"{message} (WEIGHTSERVER_REQUIRE_TOOLCHAINS=1)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def node() -> str:
    node, npm = _require_toolchain()
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"
    return node


def _raw_hex(tensor: torch.Tensor) -> str:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes().hex()


def _describe(weights: dict[str, torch.Tensor]) -> dict[str, dict]:
    """What node should find for each tensor: exact values, raw bytes (F16/BF16) or a digest."""
    dtypes = {
        torch.float32: "F32",
        torch.float64: "F64",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.bool: "BOOL",
        torch.uint8: "U8",
        torch.bfloat16: "BF16",
        torch.float16: "F16",
    }
    described = {}
    for name, tensor in weights.items():
        entry: dict = {"dtype": dtypes[tensor.dtype], "shape": list(tensor.shape)}
        flat = tensor.reshape(-1)
        if tensor.dtype in (torch.bfloat16, torch.float16):
            entry["hex"] = _raw_hex(tensor)
        elif flat.numel() > 1000:
            entry["numel"] = flat.numel()
            entry["sha256"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
            entry["samples"] = [[i, flat[i].item()] for i in (0, 1, flat.numel() // 2, flat.numel() - 1)]
        elif tensor.dtype == torch.int64:
            entry["values"] = [str(v) for v in flat.tolist()]
        elif tensor.dtype == torch.bool:
            entry["values"] = [int(v) for v in flat.tolist()]
        else:
            entry["values"] = flat.tolist()
        described[name] = entry
    return described


def _published(client: WeightClient, model: str, weights: dict[str, torch.Tensor], metadata: dict) -> dict:
    version = client.publish(weights, model=model, metadata=metadata)
    wait_until(lambda: client.describe(model, version).sha256 != "", 10)  # computed after the commit
    info = client.describe(model, version)
    return {
        "version": version,
        "metadata": metadata,
        "byte_size": info.byte_size,
        "sha256": info.sha256,
        "tensors": _describe(weights),
    }


class _KeepPublishing:
    """Publishes a new version of `model` every `interval` seconds until stopped."""

    def __init__(self, address: str, model: str, interval: float = 0.3) -> None:
        self._client = WeightClient(address)
        self._model = model
        self._interval = interval
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._step = 0

    def publish_one(self) -> None:
        # Only this thread publishes the model, so step N is version N.
        self._step += 1
        step = self._step
        version = self._client.publish(
            {"x": torch.full((4,), float(step))}, model=self._model, metadata={"step": str(step)}
        )
        assert version == step, (version, step)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self.publish_one()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def __enter__(self) -> _KeepPublishing:
        self.publish_one()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()


def test_node_client_against_live_server(node: str, make_server, tmp_path: Path) -> None:
    server = make_server()
    token_file = tmp_path / "tokens"
    token_file.write_text(f"reader node-reader {TOKEN}\npublisher node-publisher {PUBLISH_TOKEN}\n")
    auth_server = make_server(auth_tokens=token_file)
    pki = make_pki(tmp_path)
    tls_server = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])

    generator = torch.Generator().manual_seed(7)
    expected: dict = {"policy": []}
    with WeightClient(server.address) as client:
        for step in (1, 2):
            weights = {
                "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * step - 5.5,
                "count": torch.tensor([-(2**40), 0, 2**53 + step], dtype=torch.int64),
                "mask": torch.tensor([True, False, True]),
                "bf": torch.randn(5, generator=generator).to(torch.bfloat16),
                "half": torch.randn(2, 3, generator=generator).to(torch.float16),
                "scalar": torch.tensor(3.25, dtype=torch.float64),
            }
            expected["policy"].append(_published(client, "policy", weights, {"step": str(step), "run": "node-test"}))
        big = {"w": torch.randn(1_000_000, generator=generator), "ids": torch.arange(5000, dtype=torch.int64)}
        expected["big"] = _published(client, "big", big, {"kind": "multi-chunk"})
        assert expected["big"]["byte_size"] > 3 * 1024 * 1024

    with WeightClient(auth_server.address, token=PUBLISH_TOKEN) as client:
        auth_version = client.publish({"w": torch.tensor([1.0, 2.0, 3.0])}, model="policy")
    expected["auth"] = {"address": auth_server.address, "token": TOKEN, "version": auth_version, "w": [1.0, 2.0, 3.0]}
    with WeightClient(
        tls_server.address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]
    ) as client:
        tls_version = client.publish({"w": torch.tensor([4.0, 5.0])}, model="policy")
    expected["tls"] = {
        "address": tls_server.address,
        "ca": str(pki["ca"]),
        "cert": str(pki["client_cert"]),
        "key": str(pki["client_key"]),
        "other_ca": str(pki["other_ca"]),
        "version": tls_version,
        "w": [4.0, 5.0],
    }
    expected["watch"] = {"model": "watched"}

    expected_path = tmp_path / "expected.json"
    expected_path.write_text(json.dumps(expected))
    # The client's other defaults come from the environment: none leak in from the caller's.
    env = {name: value for name, value in os.environ.items() if not name.startswith("WEIGHTSERVER_")}
    env.update(WEIGHTSERVER_ADDRESS=server.address, EXPECTED_JSON=str(expected_path))
    with _KeepPublishing(server.address, "watched") as publisher:
        result = subprocess.run(
            [node, "--test", "test/"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=120
        )
    assert publisher.error is None, publisher.error
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"
    assert "# fail 0" in result.stdout and "# SKIP" not in result.stdout, result.stdout
