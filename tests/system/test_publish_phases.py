"""bench/publish_phases.py times the functions it names, and puts them back afterwards: a
rename on either side shows up here, not as a profile that quietly lacks a phase."""

from __future__ import annotations

import pytest

from bench import publish_phases
from bench.publish_phases import PHASES, profile

MiB = 1 << 20


@pytest.mark.parametrize(
    ("transport", "upload_phase", "call_phase"),
    [
        # Written in place: the Publish call is open while the bytes are written; its end is timed.
        ("shm", "client: copy and hash into the shm upload", "client: the commit, until the reply (written in place)"),
        ("bulk", "client: send the bulk upload, hashing", "client: the Publish call"),
    ],
)
def test_every_phase_of_a_fast_publish_is_timed(transport: str, upload_phase: str, call_phase: str) -> None:
    originals = [getattr(owner, name) for owner, name, _ in PHASES]
    phases = profile(MiB, transport, count=2, gap=0.0)
    expected = {
        upload_phase,
        call_phase,
        "server: Publish, receive to commit",
        "server:   the upload's digests, awaited",
        "server:     its pass over the bytes",
        "server:   the store's commit",
        "server:     adopting the file, its header",
        "publish() until committed",
    }
    assert expected <= set(phases)
    assert all(len(times) == 2 and all(t > 0 for t in times) for times in phases.values())
    # A phase lies within the call that contains it.
    total = max(phases["publish() until committed"])
    assert max(phases["server: Publish, receive to commit"]) < total
    assert max(phases[call_phase]) < total
    if transport == "bulk":
        assert max(phases["server: Publish, receive to commit"]) < max(phases[call_phase])
    else:  # the call began before the copy, and its commit after it
        assert max(phases[upload_phase]) < max(phases["server: Publish, receive to commit"])
    assert [getattr(owner, name) for owner, name, _ in PHASES] == originals


def test_main_prints_one_line_per_phase(capsys: pytest.CaptureFixture[str]) -> None:
    publish_phases.main(["--size", "1MiB", "--transport", "shm", "--count", "1", "--gap", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "publish of 1MiB over shm, 1 times, 0 s apart"
    assert lines[-1].startswith("publish() until committed")
    assert len(lines) == 1 + 8  # the shm upload, 6 shared phases, the total
