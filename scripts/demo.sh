#!/usr/bin/env bash
# Quickstart, command 1: set up, then run the actor-learner demo on embedded defaults: a weight
# server, a DDPG trainer and two torchrl collectors on PendulumEnv as separate processes, for
# 120 s of training, then a summary and a plot (demo.png here; --plot none: no plot). Extra
# arguments go to the demo (see --help), e.g.
#   ./scripts/demo.sh --seconds 60 --summary-json summary.json   # and summary.png
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m demo "$@"
