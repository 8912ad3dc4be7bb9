"""Huge pages for same-host uploads (issue 30): where the host gives shared memory huge pages only
on advice (/sys/kernel/mm/transparent_hugepage/shmem_enabled: "advise"), the server allocates an
upload's memfd through an advised mapping and the publisher maps it advised, so that the page
tables a publish sets up and tears down (before the seal) are 512 times smaller. Where it says
"never", the server logs how to turn them on.

These tests set the host's setting for their length and put it back after, also on failure: they
need root (CI runs as root; WEIGHTSERVER_REQUIRE_ROOT=1 makes a skip a failure there).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import pytest
import torch

from weightclient import WeightClient
from weightserver.protocol import page_tables

pytestmark = pytest.mark.alone  # the kernel's setting and host-wide counters: no other test runs meanwhile

MiB = 1 << 20


def shmem_huge_kb() -> int:
    """Shared memory held in huge pages now, host-wide (/proc/meminfo ShmemHugePages), in KiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1])
    raise AssertionError("/proc/meminfo has no ShmemHugePages line")


def settled_shmem_huge_kb(quiet: float = 0.3, timeout: float = 10.0) -> int:
    """`shmem_huge_kb()` once it has not changed for `quiet` seconds (within `timeout`)."""
    deadline, last, since = time.monotonic() + timeout, shmem_huge_kb(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.05)
        now = shmem_huge_kb()
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.fixture
def shmem_setting() -> Iterator:
    """Set the host's shared-memory huge page setting for the test; the first one comes back after."""
    if os.geteuid() != 0 or not os.access(page_tables.SHMEM_HUGE_PAGES, os.W_OK):
        message = f"setting {page_tables.SHMEM_HUGE_PAGES} needs root"
        if os.environ.get("WEIGHTSERVER_REQUIRE_ROOT") == "1":
            pytest.fail(f"{message} (WEIGHTSERVER_REQUIRE_ROOT=1)")
        pytest.skip(message)
    first = page_tables.shared_huge_pages()

    def set_to(value: str) -> None:
        with open(page_tables.SHMEM_HUGE_PAGES, "w") as f:
            f.write(value)
        assert page_tables.shared_huge_pages() == value

    try:
        yield set_to
    finally:
        set_to(first)


def test_a_reserved_upload_takes_huge_pages_only_where_advised(shmem_setting):
    size = 8 * MiB
    for setting, huge in (("advise", True), ("never", False)):
        shmem_setting(setting)
        before = shmem_huge_kb()
        fd = os.memfd_create("weightserver-test")
        try:
            page_tables.reserve(fd, size)
            assert os.fstat(fd).st_size == size and os.fstat(fd).st_blocks * 512 >= size  # allocated now
            grew = shmem_huge_kb() - before
        finally:
            os.close(fd)
        if huge:
            assert grew >= size // 1024, f"{setting}: only {grew} KiB of huge pages for an {size // MiB} MiB upload"
        else:
            assert grew <= 0, f"{setting}: {grew} KiB of huge pages"


def test_a_same_host_publish_lands_in_huge_pages_and_reads_back(shmem_setting, make_server):
    shmem_setting("advise")
    server = make_server(keep=2)
    weights = {"w": torch.arange(4 * MiB, dtype=torch.float32)}  # 16 MiB
    before = shmem_huge_kb()
    with WeightClient(server.address) as client:
        assert client.publish(weights, model="m", transport="shm") == 1  # (no upload set up ahead yet)
        weights["w"] += 1
        assert client.publish(weights, model="m", transport="shm") == 2  # into the upload set up ahead
        # Both versions' files are retained (keep=2). The next upload is set up in the background
        # meanwhile, so the count is read once it settles (read between the two publishes, as before,
        # it missed whatever of the spare upload for v2 was already allocated: seen in CI).
        grew = settled_shmem_huge_kb() - before
        result = client.fetch("m", version=2, transport="shm")
        assert result.stats.transport == "shm" and torch.equal(result.state_dict()["w"], weights["w"])
    assert grew >= 2 * 16 * MiB // 1024, f"two 16 MiB versions took {grew} KiB of huge pages"


def test_the_server_says_how_to_turn_them_on_where_they_are_off(shmem_setting, make_server, caplog):
    hint = "echo advise > " + page_tables.SHMEM_HUGE_PAGES
    with caplog.at_level(logging.INFO, logger="weightserver.server"):
        shmem_setting("never")
        make_server()
        assert hint in caplog.text
        caplog.clear()
        shmem_setting("advise")
        make_server()
        assert "shared-memory payloads in" in caplog.text and hint not in caplog.text
