"""`python -m demo.sharded`, the tensor-parallel example (issue 32): a trainer publishes a
transformers Llama built from a config; rank processes each keep only their shard current with
`GrpcLocalWeightUpdater(select=tensor_parallel(rank, world, LLAMA_PLAN))`; their shards,
concatenated, are every tensor of every version bit for bit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_rank_holds_its_shard_of_every_version_and_later_versions_come_as_deltas():
    done = subprocess.run(
        [sys.executable, "-m", "demo.sharded", "--world", "2", "--versions", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shares = {
        int(match[1]): [float(x) for x in match[2].split(", ")]
        for match in re.finditer(
            r"v(\d+): the 2 ranks' shards make every tensor bit for bit; .*: ([\d., ]+)", done.stdout
        )
    }
    assert sorted(shares) == [1, 2, 3], done.stdout
    assert all(0.45 <= share <= 0.6 for share in shares[1])  # its half of the split tensors, and the norms
    assert all(share < 0.2 for version in (2, 3) for share in shares[version])  # the changed elements only
