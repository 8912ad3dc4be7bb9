#!/usr/bin/env bash
# Quickstart, command 1: set up, then run the main job on embedded defaults: start a weight
# server, publish a few versions of a small policy, watch and fetch them, print versions and
# digests. Extra arguments go to scripts/demo.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
