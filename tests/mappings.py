"""Where tensors live: this process's copy-on-write mappings of same-host publishes' files (what a
collector on the server's host applies zero-copy), from /proc/self/maps."""

from __future__ import annotations

import torch

MEMFD = "memfd:weightserver-"  # how /proc/self/maps names a same-host publish's file


def version_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's private (copy-on-write: a collector's) mappings of same-host
    publishes' files; a server in this process maps them shared."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if MEMFD in line and line.split()[1].endswith("p"):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                found.append((start, end))
    return found


def views_a_version(tensor: torch.Tensor) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end in version_mappings())
