"""Quickstart, command 1 (run by scripts/demo.sh): the actor-learner demo, `python -m demo`.

A weight server, a DDPG trainer and two torchrl collectors on PendulumEnv, on this machine,
for `--seconds` (default 120); see `--help` for every setting and its environment variable.
The earlier publish/watch/fetch/restart round trip is `python -m demo.roundtrip`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root holds `demo`

from demo.run import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
