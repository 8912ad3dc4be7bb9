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


def test_waiting_for_a_server_that_answers_not_serving_ends_at_the_deadline():
    """wait_serving (and so ServerProcess.start(timeout=...)) gives up at its deadline also when the
    server answers but not SERVING (say, it is in its shutdown's grace). Before, only a failed call
    looked at the deadline: the wait polled such a server forever."""
    import threading
    import time
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from weightserver.process import wait_serving

    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        outcome: list[BaseException | None] = []

        def wait() -> None:
            try:
                wait_serving(f"127.0.0.1:{port}", time.monotonic() + 1.0)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(15)
        assert outcome, "wait_serving was still waiting 15 s after its 1 s deadline"
        assert isinstance(outcome[0], TimeoutError) and "NOT_SERVING" in str(outcome[0])
    finally:
        server.stop(0)
