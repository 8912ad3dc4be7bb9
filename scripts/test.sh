#!/usr/bin/env bash
# Quickstart, command 2: set up, then lint and run the whole test suite, on 2 workers
# (pytest-xdist; WEIGHTSERVER_TEST_WORKERS=N for N, 0 for none). Each test file runs on one
# worker (--dist loadfile), so a module's fixtures are built once (a 4 GiB model, a Ray cluster,
# the C++ build); a test marked alone runs while no other does (tests/alone.py). A worker that
# dies (killed for memory, say) fails the run rather than be replaced: --max-worker-restart=0.
# Extra arguments go to pytest (e.g. scripts/test.sh -k watch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -n "${WEIGHTSERVER_TEST_WORKERS:-2}" --dist loadfile --max-worker-restart=0 "$@"
