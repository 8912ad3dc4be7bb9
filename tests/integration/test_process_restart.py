"""The standalone server (`weightserver serve` in a child process) with --data-dir:
retained versions survive a graceful restart and a SIGKILL, digests intact."""

from __future__ import annotations

import pytest
import torch

from weightclient import WeightClient
from weightserver.process import ServerProcess


def _publish_versions(address: str, count: int) -> dict[int, tuple[str, dict[str, torch.Tensor]]]:
    published = {}
    with WeightClient(address) as client:
        for i in range(count):
            weights = {"w": torch.full((64, 64), float(i)), "step": torch.tensor(i)}
            version = client.publish(weights, model="policy", metadata={"i": str(i)})
            published[version] = (client.describe("policy", version).sha256, weights)
    return published


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_retained_versions_come_back_after_restart(tmp_path, how):
    server = ServerProcess("--data-dir", str(tmp_path / "data"), "--keep", "3").start()
    try:
        published = _publish_versions(server.address, 5)
        if how == "sigterm":
            assert server.stop() == 0
        else:
            server.kill()
        server.start()
        with WeightClient(server.address) as client:
            versions = client.list_versions("policy")
            assert [v.version for v in versions] == [3, 4, 5]  # keep=3
            for info in versions:
                digest, weights = published[info.version]
                assert info.sha256 == digest
                result = client.fetch("policy", version=info.version)
                assert result.metadata == {"i": str(info.version - 1)}
                for name, tensor in weights.items():
                    assert torch.equal(result.state_dict()[name], tensor)
            # numbering continues after the restart
            assert client.publish({"w": torch.zeros(1)}, model="policy") == 6
    finally:
        server.kill()
    assert "loaded model 'policy': versions 3-5" in server.log()


def test_torn_file_is_skipped_on_restart_and_logged(tmp_path):
    data = tmp_path / "data"
    server = ServerProcess("--data-dir", str(data)).start()
    try:
        _publish_versions(server.address, 3)
        server.stop()
        torn = data / "policy" / f"{3:012d}.safetensors"
        torn.write_bytes(torn.read_bytes()[:-100])  # as if the disk lost the tail
        server.start()
        with WeightClient(server.address) as client:
            assert [v.version for v in client.list_versions("policy")] == [1, 2]
            assert client.fetch("policy").version == 2
    finally:
        server.kill()
    assert "torn or corrupt version" in server.log()


def test_sigterm_shuts_down_gracefully(tmp_path):
    server = ServerProcess().start()
    assert server.stop() == 0
    log = server.log()
    assert "received SIGTERM" in log and "stopped" in log
