#!/usr/bin/env bash
# Quickstart, command 2: set up, then lint and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k watch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
