"""usable_cpus: the affinity, capped by a container's CPU quota, which both sides size their threads by."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightserver.protocol import cpus


@pytest.fixture(autouse=True)
def _quota_read_afresh():
    """cpu_quota() is read once per process: each test reads the files it points it at."""
    cpus.cpu_quota.cache_clear()
    yield
    cpus.cpu_quota.cache_clear()


@pytest.mark.parametrize(
    ("cpu_max", "affinity", "usable"),
    [
        ("max 100000\n", 16, 16),
        ("200000 100000\n", 16, 2),
        ("150000 100000\n", 16, 2),
        ("800000 100000\n", 4, 4),
        ("", 16, 16),  # a file not as documented: no limit read from it, rather than an error
        ("1 2 3\n", 16, 16),
    ],
)
def test_a_cgroup_v2_quota_caps_the_affinity_rounded_up(tmp_path, monkeypatch, cpu_max, affinity, usable):
    """A container run with `--cpus 2` on a 16-core host sees 16 cores in its affinity and may use two."""
    (tmp_path / "cpu.max").write_text(cpu_max)
    monkeypatch.setattr(cpus, "CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(cpus, "CFS_QUOTA", tmp_path / "absent")  # (this host's own v1 files play no part)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    assert cpus.usable_cpus() == usable


@pytest.mark.parametrize(("quota", "usable"), [("-1", 8), ("50000", 1), ("250000", 3)])
def test_without_cgroup_v2_the_v1_quota_beside_its_period_caps_it(tmp_path, monkeypatch, quota, usable):
    (tmp_path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(cpus, "CPU_MAX", tmp_path / "absent" / "cpu.max")
    monkeypatch.setattr(cpus, "CFS_QUOTA", tmp_path / "cpu.cfs_quota_us")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpus.usable_cpus() == usable
    monkeypatch.setattr(cpus, "CFS_QUOTA", tmp_path / "absent" / "cpu.cfs_quota_us")  # no cgroup files: no limit
    cpus.cpu_quota.cache_clear()  # (read once per process: read again from the new paths)
    assert cpus.usable_cpus() == 8 and cpus.cpu_quota() is None


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(
    os.geteuid() != 0 or not (V1_CPU / "cpu.cfs_quota_us").exists() or len(os.sched_getaffinity(0)) < 2,
    reason="needs root, a cgroup v1 cpu controller at /sys/fs/cgroup/cpu and 2+ CPUs",
)
def test_a_process_in_a_container_with_half_a_cpu_sizes_its_threads_for_one():
    """What `docker run --cpus 0.5` does on a cgroup v1 host, done by hand: a cpu cgroup of its own
    with 50 ms per 100 ms, mounted over /sys/fs/cgroup/cpu in a mount namespace of its own. A
    process there counts one usable CPU; this one, outside, counts its affinity."""
    group = V1_CPU / f"weightserver-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        ask = "from weightserver.protocol.cpus import usable_cpus, cpu_quota; print(usable_cpus(), cpu_quota())"
        inside = f"echo $$ > {group}/cgroup.procs && mount --bind {group} {V1_CPU} && exec {sys.executable} -c '{ask}'"
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inside],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1", "0.5"]
        assert cpus.usable_cpus() == len(os.sched_getaffinity(0)) and cpus.cpu_quota() is None
    finally:
        for _ in range(100):  # the child has exited: its cgroup empties at once, or very soon after
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.05)
