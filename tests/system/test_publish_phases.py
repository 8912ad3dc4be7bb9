"""bench/publish_phases.py reads the server's own per-phase timing of each publish: the figures
must add up within the call, and a known stall must show in the phase it falls in."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch
import xxhash

from bench import publish_phases
from bench.publish_phases import SERVER_PHASES, TOTAL, profile, publish_records
from tests.integration.test_publish_transports import file_of
from weightserver.protocol import framing
from weightserver.server import WeightServer
from weightserver.v1 import weights_pb2 as pb

MiB = 1 << 20
RECEIVE, VERIFY, COMMIT, CALL = (label for _, label in SERVER_PHASES)


@pytest.mark.parametrize("transport", ["shm", "bulk", "stream"])
def test_the_phases_of_a_publish_add_up_within_its_call(transport: str) -> None:
    phases = profile(MiB, transport, count=2, gap=0.0)
    assert set(phases) == {label for _, label in SERVER_PHASES} | {TOTAL}
    assert all(len(times) == 2 and all(t >= 0 for t in times) for times in phases.values())
    for i in range(2):
        parts = phases[RECEIVE][i] + phases[VERIFY][i] + phases[COMMIT][i]
        assert phases[COMMIT][i] > 0 and parts <= phases[CALL][i] + 0.2  # logged to 0.001 ms each
        assert phases[CALL][i] < phases[TOTAL][i]


def test_a_stalled_publisher_shows_in_the_receive_phase_only() -> None:
    """A publisher that waits 0.3 s between its header and its bytes: the server's receive phase
    holds those 0.3 s, and neither verify nor commit does."""
    data = file_of({"w": torch.arange(1 << 16, dtype=torch.float32)})
    header = pb.PublishHeader(model="m", total_bytes=len(data), xxh3=xxhash.xxh3_128_hexdigest(data))

    def messages() -> Iterator[object]:
        yield pb.PublishRequest(header=header)
        time.sleep(0.3)
        yield from framing.chunk_messages(data, MiB, framing.PUBLISH_CHUNK_TAG)
        yield pb.PublishRequest(commit=pb.PublishCommit())

    with publish_records() as logged, WeightServer() as server, grpc.insecure_channel(server.address) as channel:
        call = channel.stream_unary(
            "/weightserver.v1.WeightService/Publish",
            request_serializer=framing.serialize,
            response_deserializer=pb.PublishResponse.FromString,
        )
        started = time.perf_counter()
        call(messages(), timeout=30)
        elapsed_ms = (time.perf_counter() - started) * 1e3
    (record,) = logged.records
    # (the header's message also sets the call up, so it can land a few ms after the client's sleep
    # began, while the chunk after it lands at once: the server sees 299.2 ms at times)
    assert 290 <= record.receive_ms <= record.duration_ms <= elapsed_ms
    assert record.verify_ms < 250 and record.commit_ms < 250


def test_main_prints_one_line_per_phase(capsys: pytest.CaptureFixture[str]) -> None:
    publish_phases.main(["--size", "1MiB", "--transport", "shm", "--count", "1", "--gap", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "publish of 1MiB over shm, 1 times, 0 s apart"
    assert [line.split(" p50 ")[0].rstrip() for line in lines[1:]] == [TOTAL] + [label for _, label in SERVER_PHASES]
