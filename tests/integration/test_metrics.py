"""Prometheus metrics (`serve --metrics-port`) scraped over real HTTP from real servers."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import urllib.error
import urllib.request

import google.protobuf
import grpc
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_equal

import weightserver
from weightclient.core.service_client import WeightServiceClient
from weightserver import WeightServer
from weightserver.metrics import DURATION_BUCKETS, ServerMetrics, build_labels
from weightserver.process import ServerProcess
from weightserver.protocol.errors import InvalidSafetensors
from weightserver.protocol.safetensors_format import build_header
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def weights(nbytes: int, fill: int = 1) -> bytes:
    """A safetensors file with one U8 tensor of `nbytes`."""
    prefix, _ = build_header([("w", "U8", (nbytes,), nbytes)])
    return prefix + bytes([fill % 256]) * nbytes


def scrape(server: WeightServer) -> Samples:
    assert server.metrics_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_for_value(server: WeightServer, name: str, expected: float, **labels: str) -> None:
    wait_equal(lambda: value(scrape(server), name, **labels), expected, what=f"{name}{labels} == {expected}")


@pytest.fixture
def metered(make_server) -> WeightServer:
    return make_server(metrics_port=0)


def test_metrics_are_off_unless_asked_for(server):
    assert server.metrics_port is None and server.metrics_url is None


def test_metrics_port_is_bound_and_reported(metered):
    assert metered.metrics_port and metered.metrics_port != metered.port
    assert metered.metrics_url == f"http://127.0.0.1:{metered.metrics_port}/metrics"
    assert value(scrape(metered), "weightserver_versions_published_total", model="policy") is None


def test_publishes_count_versions_bytes_and_durations(metered):
    v1, v2, other = weights(1000), weights(3000, 2), weights(500)
    with WeightServiceClient(metered.address, client_id="trainer") as client:
        client.publish_bytes("policy", v1)
        client.publish_bytes("policy", v2)
        client.publish_bytes("critic", other)
        with pytest.raises(InvalidSafetensors):
            client.publish_bytes("policy", b"\x00" * 16)  # refused: counts nothing
    samples = scrape(metered)
    assert value(samples, "weightserver_versions_published_total", model="policy") == 2
    assert value(samples, "weightserver_versions_published_total", model="critic") == 1
    assert value(samples, "weightserver_publish_bytes_total", model="policy") == len(v1) + len(v2)
    assert value(samples, "weightserver_publish_bytes_total", model="critic") == len(other)
    assert value(samples, "weightserver_publish_duration_seconds_count", model="policy") == 2
    assert value(samples, "weightserver_publish_duration_seconds_sum", model="policy") > 0
    bounds = {
        float(dict(labels)["le"])
        for name, labels in samples
        if name == "weightserver_publish_duration_seconds_bucket" and dict(labels)["model"] == "policy"
    }
    assert bounds == {*DURATION_BUCKETS, float("inf")} and min(bounds) == 0.001 and 60.0 in bounds
    assert value(samples, "weightserver_publish_duration_seconds_bucket", model="policy", le="+Inf") == 2
    # What the server holds now.
    assert value(samples, "weightserver_latest_version", model="policy") == 2
    assert value(samples, "weightserver_retained_versions", model="policy") == 2
    assert value(samples, "weightserver_retained_bytes", model="policy") == len(v1) + len(v2)


def test_retention_gauges_follow_eviction_and_delete(make_server):
    srv = make_server(metrics_port=0, keep=2)
    sizes = [100, 200, 300]
    with WeightServiceClient(srv.address) as client:
        for size in sizes:
            client.publish_bytes("policy", weights(size))
        samples = scrape(srv)
        assert value(samples, "weightserver_retained_versions", model="policy") == 2
        assert value(samples, "weightserver_retained_bytes", model="policy") == len(weights(200)) + len(weights(300))
        client.delete("policy", 3)
    samples = scrape(srv)
    assert value(samples, "weightserver_latest_version", model="policy") == 2
    assert value(samples, "weightserver_retained_versions", model="policy") == 1
    assert value(samples, "weightserver_retained_bytes", model="policy") == len(weights(200))


def test_fetches_count_payload_bytes_per_transport(metered):
    data = weights(70_000)
    with WeightServiceClient(metered.address, client_id="collector-1") as client:
        client.publish_bytes("policy", data)
        for transport in ("stream", "stream", "bulk", "shm"):
            fetched = client.fetch_bytes("policy", transport=transport)
            assert fetched is not None and fetched.stats is not None and fetched.stats.transport == transport
        assert client.fetch_bytes("policy", newer_than=1) is None  # up to date: nothing served
    samples = scrape(metered)
    assert value(samples, "weightserver_fetch_bytes_total", model="policy", transport="stream") == 2 * len(data)
    assert value(samples, "weightserver_fetch_bytes_total", model="policy", transport="bulk") == len(data)
    assert value(samples, "weightserver_fetch_bytes_total", model="policy", transport="shm") == len(data)
    assert value(samples, "weightserver_fetch_duration_seconds_count", model="policy", transport="stream") == 2
    assert value(samples, "weightserver_fetch_duration_seconds_count", model="policy", transport="bulk") == 1
    assert value(samples, "weightserver_fetch_duration_seconds_count", model="policy", transport="shm") == 1
    assert value(samples, "weightserver_fetch_duration_seconds_sum", model="policy", transport="stream") > 0


def test_active_watchers_rise_during_a_watch_and_fall_after(metered):
    with WeightServiceClient(metered.address) as publisher, WeightServiceClient(metered.address) as watcher:
        publisher.publish_bytes("policy", weights(10))
        first = watcher.watch("policy", since=0, timeout=30)
        second = watcher.watch("policy", since=0, timeout=30)
        assert next(first).info.version == 1  # the server subscribed before sending the backlog
        assert next(second).info.version == 1
        assert value(scrape(metered), "weightserver_active_watchers", model="policy") == 2
        first.close()  # cancels the call
        wait_for_value(metered, "weightserver_active_watchers", 1, model="policy")
        second.close()
        wait_for_value(metered, "weightserver_active_watchers", 0, model="policy")


def test_watches_of_models_the_server_does_not_hold_leave_no_series_behind(metered):
    """A Watch of a model with no version yet is counted while it runs; once the last one ends, the
    series goes (a held model's stays, at zero). Before, every name ever watched kept its series for
    good: a reader watching made-up names grew the server's memory and every scrape without bound."""
    with grpc.insecure_channel(metered.address) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        for name in ("ghost-1", "ghost-2"):
            first, second = (stub.Watch(pb.WatchRequest(model=name), timeout=30) for _ in range(2))
            wait_for_value(metered, "weightserver_active_watchers", 2, model=name)
            first.cancel()
            wait_for_value(metered, "weightserver_active_watchers", 1, model=name)
            second.cancel()
            wait_for_value(metered, "weightserver_active_watchers", None, model=name)


def test_per_client_last_version_and_lag(metered):
    def client_gauges(client_id: str) -> tuple[float | None, float | None]:
        samples = scrape(metered)
        labels = {"client_id": client_id, "model": "policy"}
        return (
            value(samples, "weightserver_client_last_fetched_version", **labels),
            value(samples, "weightserver_client_version_lag", **labels),
        )

    address = metered.address
    with (
        WeightServiceClient(address, client_id="trainer") as trainer,
        WeightServiceClient(address, client_id="collector-1") as slow,
        WeightServiceClient(address, client_id="collector-2") as fast,
        WeightServiceClient(address) as anonymous,
    ):
        trainer.publish_bytes("policy", weights(64, 1))
        slow.fetch_bytes("policy", transport="stream")
        assert client_gauges("collector-1") == (1, 0)

        trainer.publish_bytes("policy", weights(64, 2))
        trainer.publish_bytes("policy", weights(64, 3))
        assert client_gauges("collector-1") == (1, 2)  # publishes alone grow the lag

        fast.fetch_bytes("policy", transport="bulk")
        assert client_gauges("collector-2") == (3, 0)
        fast.fetch_bytes("policy", version=2, transport="stream")
        assert client_gauges("collector-2") == (2, 1)

        slow.fetch_bytes("policy")
        assert client_gauges("collector-1") == (3, 0)
        anonymous.fetch_bytes("policy")

    samples = scrape(metered)
    tracked = {dict(labels)["client_id"] for name, labels in samples if name == "weightserver_client_version_lag"}
    assert tracked == {"collector-1", "collector-2"}  # only clients that fetched and sent an id


def test_tracked_client_ids_are_capped():
    metrics = ServerMetrics(max_tracked_clients=2)
    for client_id in ("a", "b", "c"):
        metrics.fetched("policy", 1, 10, 0.01, transport="stream", client_id=client_id)
    metrics.fetched("policy", 1, 10, 0.01, transport="stream", client_id="a")  # known ids stay tracked

    def lag(client_id: str) -> float | None:
        return metrics.registry.get_sample_value(
            "weightserver_client_version_lag", {"client_id": client_id, "model": "policy"}
        )

    assert (lag("a"), lag("b"), lag("c")) == (0, 0, None)
    total = metrics.registry.get_sample_value(
        "weightserver_fetch_bytes_total", {"model": "policy", "transport": "stream"}
    )
    assert total == 40  # untracked clients are still counted


def test_each_server_has_its_own_registry(make_server):
    first, second = make_server(metrics_port=0), make_server(metrics_port=0)
    with WeightServiceClient(first.address) as client:
        client.publish_bytes("policy", weights(10))
    assert value(scrape(first), "weightserver_versions_published_total", model="policy") == 1
    assert value(scrape(second), "weightserver_versions_published_total", model="policy") is None
    for srv in (first, second):  # the standard collectors too, registered once per server
        samples = scrape(srv)
        assert value(samples, "process_cpu_seconds_total") > 0
        assert value(samples, "weightserver_build_info", **build_labels()) == 1


def test_standard_collectors_go_to_each_servers_registry_not_the_global_one():
    first, second = ServerMetrics(), ServerMetrics()  # a duplicate registration would raise here
    assert first.registry is not second.registry and REGISTRY not in (first.registry, second.registry)
    for metrics in (first, second):
        assert metrics.registry.get_sample_value("process_cpu_seconds_total") > 0
        assert metrics.registry.get_sample_value("weightserver_build_info", build_labels()) == 1
    assert REGISTRY.get_sample_value("weightserver_build_info", build_labels()) is None


def test_a_fresh_server_shows_process_python_and_build_series(metered):
    samples = scrape(metered)
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_resident_memory_bytes") > 1_000_000
    assert value(samples, "process_open_fds") > 0
    python = {dict(labels)["version"]: v for (name, labels), v in samples.items() if name == "python_info"}
    assert python == {platform.python_version(): 1}
    assert value(samples, "python_gc_collections_total", generation="0") is not None
    build = [dict(labels) for name, labels in samples if name == "weightserver_build_info"]
    assert build == [build_labels()]
    assert value(samples, "weightserver_build_info", **build_labels()) == 1
    assert build[0]["version"] == weightserver.__version__  # the installed metadata agrees with the source
    assert build[0]["grpc"] == grpc.__version__ and build[0]["python"] == platform.python_version()
    assert build[0]["protobuf"] == google.protobuf.__version__


def test_a_model_first_published_gets_all_its_series(make_server):
    srv = make_server(metrics_port=0, bulk_port=None)  # shm and stream only
    with WeightServiceClient(srv.address) as client:
        client.publish_bytes("critic", weights(10))
    samples = scrape(srv)
    assert value(samples, "weightserver_versions_published_total", model="critic") == 1
    assert value(samples, "weightserver_active_watchers", model="critic") == 0
    for transport in ("stream", "shm"):
        assert value(samples, "weightserver_fetch_bytes_total", model="critic", transport=transport) == 0
        assert value(samples, "weightserver_fetch_duration_seconds_count", model="critic", transport=transport) == 0
    assert value(samples, "weightserver_fetch_bytes_total", model="critic", transport="bulk") is None  # not served


def test_versions_loaded_from_the_data_dir_are_reported(make_server, tmp_path):
    first = make_server(data_dir=tmp_path)
    with WeightServiceClient(first.address) as client:
        client.publish_bytes("policy", weights(10))
        client.publish_bytes("policy", weights(20))
        client.publish_bytes("critic", weights(30))
    first.stop(grace=0)
    restarted = make_server(data_dir=tmp_path, metrics_port=0)
    samples = scrape(restarted)
    assert value(samples, "weightserver_latest_version", model="policy") == 2
    assert value(samples, "weightserver_retained_versions", model="policy") == 2
    assert value(samples, "weightserver_retained_bytes", model="policy") == len(weights(10)) + len(weights(20))
    assert value(samples, "weightserver_latest_version", model="critic") == 1
    # Every series of a loaded model is there before any publish, counted from this start.
    for model in ("policy", "critic"):
        assert value(samples, "weightserver_versions_published_total", model=model) == 0
        assert value(samples, "weightserver_publish_bytes_total", model=model) == 0
        assert value(samples, "weightserver_publish_duration_seconds_count", model=model) == 0
        assert value(samples, "weightserver_publish_duration_seconds_bucket", model=model, le="+Inf") == 0
        assert value(samples, "weightserver_active_watchers", model=model) == 0
        for transport in ("stream", "bulk", "shm"):
            assert value(samples, "weightserver_fetch_bytes_total", model=model, transport=transport) == 0
            assert value(samples, "weightserver_fetch_duration_seconds_count", model=model, transport=transport) == 0


def test_metrics_endpoint_closes_with_the_server(make_server):
    srv = make_server(metrics_port=0)
    url = srv.metrics_url
    scrape(srv)
    srv.stop(grace=0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_metrics_port_in_use_fails_the_start(make_server):
    first = make_server(metrics_port=0)
    with pytest.raises(OSError):
        make_server(metrics_port=first.metrics_port)


def test_metrics_port_must_be_a_port():
    from weightserver import ServerConfig

    with pytest.raises(ValueError, match="metrics_port"):
        ServerConfig(metrics_port=70000)


def test_serve_help_shows_metrics_port():
    result = subprocess.run(
        [sys.executable, "-m", "weightserver", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--metrics-port PORT" in result.stdout


def test_serve_metrics_port_flag_serves_metrics():
    with ServerProcess("--metrics-port", "0") as process:
        with WeightServiceClient(process.address) as client:
            client.publish_bytes("policy", weights(10))
        match = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", process.log())
        assert match, process.log()
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    assert 'weightserver_versions_published_total{model="policy"} 1.0' in text
