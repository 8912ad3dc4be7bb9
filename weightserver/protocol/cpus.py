"""The CPUs this process may use, which both sides size their threads by: its affinity, capped by a
container's CPU quota (`docker run --cpus`, a Kubernetes CPU limit), which the affinity does not show."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

# A container's own quota, in microseconds per period: cgroup v2's "<quota> <period>" ("max": none),
# else cgroup v1's quota (-1: none) beside its period. On a host these are the root's: no limit.
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CFS_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")


def usable_cpus() -> int:
    """The affinity's CPUs, at most the quota rounded up (1.5 CPUs of time: 2 threads)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # (Linux only)
    quota = cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


@functools.cache  # (a container's quota is set when it starts; a file read costs 25 us, on every large read)
def cpu_quota() -> float | None:
    """CPUs of time per period this process's container allows; None without a limit."""
    try:
        quota, period = CPU_MAX.read_text().split()
    except (OSError, ValueError):  # (not "<quota> <period>": not a cgroup v2 file we know)
        try:
            quota, period = CFS_QUOTA.read_text(), CFS_QUOTA.with_name("cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        return int(quota) / int(period) if int(quota) > 0 else None
    except ValueError:  # "max"
        return None
