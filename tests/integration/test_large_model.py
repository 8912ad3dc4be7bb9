"""A 4 GiB model round trip (issue 15): one float32 tensor of 4 GiB + 4 KiB, so the file and the
tensor are each over 2^31 and 2^32 bytes, published and fetched back bit-exact over every
transport, as bytes and placed into a live module.

One server and one model for the whole module: the module's weight is filled once with its
element index as int32 bits, so a byte landing anywhere but its own place changes the digest,
and each test compares xxh3-128 digests of 4 GiB (a fraction of a second), never elements.
At most one 4 GiB copy lives beside the module's own and the server's (about 12.5 GiB at
the peak), so the tests need that much memory free; CI sets WEIGHTSERVER_REQUIRE_LARGE=1 so
that they never pass by being skipped there.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
import xxhash
from waiting import wait_until

import weightserver.transports.bulk as bulk
from weightclient import WeightClient
from weightserver import ServerConfig, WeightServer
from weightserver.v1 import weights_pb2 as pb
from weightserver.v1 import weights_pb2_grpc as pb_grpc

# Each test runs alone (scripts/test.sh runs 2 workers): at its peak it needs most of the host's
# memory, and beside another test's few GiB a 24 GiB machine ran out.
pytestmark = pytest.mark.alone

GiB = 1 << 30
MODEL = "large"
ELEMENTS = GiB + 1024  # float32: 4 GiB + 4 KiB in one tensor
TENSOR_BYTES = ELEMENTS * 4
NEEDED_MEMORY = 13 * GiB  # the module's tensor, the server's copy, one fetched copy, and slack
NEEDED_SHM = 9 * GiB  # the server's copy of one version, and of the next while it commits


def large_test(test):
    """Marks a test of the 4 GiB model: slow, and more time than the suite's default."""
    return pytest.mark.slow(pytest.mark.timeout(600)(test))


@dataclass
class LargeModel:
    server: WeightServer
    client: WeightClient
    module: torch.nn.Module
    version: int  # the latest version published, which the module held when it was published
    digest: str  # xxh3-128 of its tensor's bytes


def memory_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fill(weight: torch.Tensor, seed: int) -> str:
    """Element i of `weight` gets the int32 bits i + seed; returns the tensor's xxh3-128."""
    bits = weight.data.view(torch.int32)
    torch.arange(seed, seed + ELEMENTS, dtype=torch.int32, out=bits)
    return digest_of(weight)


def digest_of(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(tensor.detach().numpy()).cast("B"))


def tensor_digest(data: memoryview, info) -> str:
    """xxh3-128 of the one tensor's bytes in a fetched safetensors file."""
    (entry,) = info.tensors
    data_start = 8 + int.from_bytes(data[:8], "little")  # after the header's length and the header
    return xxhash.xxh3_128_hexdigest(data[data_start + entry.begin : data_start + entry.end])


@pytest.fixture(scope="module")
def large() -> Iterator[LargeModel]:
    """A server (keep=1) holding one version of the 4 GiB model, published over the stream,
    and the client and module that published it."""
    required = os.environ.get("WEIGHTSERVER_REQUIRE_LARGE") == "1"
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    if memory_available() < NEEDED_MEMORY or shm_free < NEEDED_SHM:
        why = (
            f"the 4 GiB round trip needs {NEEDED_MEMORY / GiB:.0f} GiB of memory and {NEEDED_SHM / GiB:.0f} GiB "
            f"free in /dev/shm; {memory_available() / GiB:.1f} GiB and {shm_free / GiB:.1f} GiB are available"
        )
        if required:
            pytest.fail(f"WEIGHTSERVER_REQUIRE_LARGE=1 but {why}")
        pytest.skip(why)
    server = WeightServer(ServerConfig(host="127.0.0.1", port=0, keep=1)).start()
    try:
        # Each call's deadline sits under the test's own 600 s: these tests check a >4 GiB file's
        # bytes, not speed (bench/large.py times it). A 4 GiB stream fetch takes 20-30 s here; a
        # fetch that gives no timeout has this one (until bb20184 it had retry_seconds, 30 s).
        with WeightClient(server.address, timeout=540) as client:
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(torch.empty(ELEMENTS), requires_grad=False)
            digest = fill(module.weight, 0)
            version = client.publish(module, model=MODEL, transport="stream")
            yield LargeModel(server, client, module, version, digest)
    finally:
        server.stop(grace=0)


@large_test
def test_the_server_holds_what_the_stream_published(large: LargeModel) -> None:
    info = large.client.describe(MODEL, large.version)
    (entry,) = info.tensors
    assert entry.nbytes == TENSOR_BYTES > 2**32 and info.byte_size > 2**32
    assert tuple(entry.shape) == (ELEMENTS,)
    assert entry.xxh3 == large.digest  # hashed by the server from the bytes it received


@large_test
@pytest.mark.parametrize("transport", ["stream", "bulk", "shm"])
def test_fetch_bytes(large: LargeModel, transport: str) -> None:
    fetched = large.client.fetch_bytes(MODEL, version=large.version, transport=transport)
    assert fetched.stats.transport == transport
    assert fetched.data.nbytes == fetched.info.byte_size
    assert tensor_digest(fetched.data, fetched.info) == large.digest


@large_test
@pytest.mark.parametrize("transport", ["stream", "bulk", "shm"])
def test_fetch_placed_into_a_live_module(large: LargeModel, transport: str) -> None:
    weight = large.module.weight
    weight.data.view(torch.int32).fill_(-1)
    result = large.client.fetch(
        MODEL, version=large.version, transport=transport, place=lambda info: {"weight": weight}
    )
    assert result.placed and result.stats.transport == transport
    assert result.tensors["weight"] is weight
    assert digest_of(weight) == large.digest


@large_test
def test_fetch_tensors_into_a_reused_buffer(large: LargeModel) -> None:
    """fetch(into=...): the tensor views the caller's buffer, offset past 2^31 elements and all."""
    size = large.client.describe(MODEL, large.version).byte_size
    buffer = np.empty(size, dtype=np.uint8)
    result = large.client.fetch(MODEL, version=large.version, transport="bulk", into=memoryview(buffer))
    weight = result.tensors["weight"]
    assert result.stats.transport == "bulk"
    assert buffer.ctypes.data <= weight.data_ptr() < buffer.ctypes.data + size
    assert weight.view(torch.int32)[[0, 2**31 // 4, 2**32 // 4, -1]].tolist() == [0, 2**29, 2**30, ELEMENTS - 1]
    assert digest_of(weight) == large.digest


@large_test
@pytest.mark.parametrize("transport", ["bulk", "shm"])
def test_publish_over_a_fast_transport(large: LargeModel, transport: str, caplog: pytest.LogCaptureFixture) -> None:
    """New contents published over bulk TCP or shared memory, then read back placed (over
    shared memory, the quickest) and compared by digest. The older version is deleted first,
    so that the server holds one 4 GiB version at a time."""
    weight = large.module.weight
    digest = fill(weight, {"bulk": 1, "shm": 2}[transport])
    large.client.delete(MODEL, large.version)
    with caplog.at_level(logging.INFO, logger="weightserver.service.servicer"):
        version = large.client.publish(large.module, model=MODEL, transport=transport)
    large.version, large.digest = version, digest
    (event,) = [r for r in caplog.records if getattr(r, "event", None) == "publish"]
    assert event.transport == transport and event.version == version
    assert large.client.describe(MODEL, version).tensors[0].xxh3 == digest  # hashed by the server as it landed
    weight.data.view(torch.int32).fill_(-1)
    result = large.client.fetch(MODEL, version=version, transport="shm", place=lambda info: {"weight": weight})
    assert result.placed and digest_of(weight) == digest


@pytest.mark.parametrize("direction", ["fetch", "publish"])
def test_a_kept_bulk_connection_lets_go_of_the_bytes_it_moved(
    server: WeightServer, client: WeightClient, direction: str
) -> None:
    """A client keeps its bulk connection open for its next ticket; while it waits, the server
    must not keep the last payload it sent (or the upload it received) alive: a version evicted
    or deleted meanwhile would stay in memory (a second 4 GiB beside the next version of a
    large model) until that client moved something again or sat idle for IDLE_CONNECTION_SECONDS."""
    transport = "bulk" if direction == "publish" else "stream"
    version = client.publish({"w": torch.ones(1024)}, model=MODEL, transport=transport)
    if direction == "publish":
        assert client.transports.usable("bulk") is True  # it carried the upload
    else:
        assert client.fetch_bytes(MODEL, transport="bulk").stats.transport == "bulk"
    memory = weakref.ref(server.store.get(MODEL, version).data.obj)
    client.delete(MODEL, version)
    # Gone within seconds, not IDLE_CONNECTION_SECONDS: a thread that took the version before the
    # delete (its sha256, 0.5 s after the commit) may hold it a moment longer (seen once in CI).
    wait_until(lambda: gc.collect() >= 0 and memory() is None, timeout=5)


def test_an_unused_bulk_ticket_lets_go_of_its_bytes_when_it_expires(
    server: WeightServer, client: WeightClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetcher that negotiated a bulk ticket and never used it (it crashed, or fell back)
    must not keep the payload in memory past the ticket's expiry, whether or not another
    ticket is ever issued: it may be a whole large version, evicted meanwhile."""
    monkeypatch.setattr(bulk, "TICKET_TTL_SECONDS", 0.2)
    version = client.publish({"w": torch.ones(1024)}, model=MODEL, transport="stream")
    request = pb.NegotiateRequest(
        direction=pb.DIRECTION_FETCH, accept=[pb.TRANSPORT_BULK], fetch=pb.FetchRequest(model=MODEL)
    )
    with grpc.insecure_channel(server.address) as channel:
        assert pb_grpc.WeightServiceStub(channel).Negotiate(request, timeout=30).transport == pb.TRANSPORT_BULK
    memory = weakref.ref(server.store.get(MODEL, version).data.obj)
    client.delete(MODEL, version)
    wait_until(lambda: gc.collect() >= 0 and memory() is None, timeout=10)


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_a_cast_needs_little_more_memory_than_its_output(dtype: str) -> None:
    """A server-side cast of a large float32 tensor (fetch(dtype=...)) must not hold several
    whole-tensor temporaries at once: for a 4 GiB tensor that was 8 GiB more for a BF16 cast.
    Measured in a fresh process, on a 256 MiB tensor: the peak RSS the cast adds is its output
    and a few blocks, at most."""
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from weightserver.storage.payloads import cast_f32
        def status(field):
            return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) << 10
        values = np.empty(64 << 20, dtype=np.float32)  # 256 MiB
        values.fill(1.5)  # every page touched
        # Not ru_maxrss: it keeps the forking parent's peak across exec, which hid the cast's.
        with open("/proc/self/clear_refs", "w") as peak:
            peak.write("5")  # the peak RSS (VmHWM) starts again from what the process holds now
        before = status("VmRSS")
        out = cast_f32(memoryview(values).cast("B"), sys.argv[1])
        print(status("VmHWM") - before, len(out))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, dtype], capture_output=True, text=True, env=env, check=True)
    added, output = map(int, done.stdout.split())
    assert output == 128 << 20
    assert added <= output + (64 << 20), f"the cast added {added >> 20} MiB for a {output >> 20} MiB output"
