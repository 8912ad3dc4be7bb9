#!/usr/bin/env bash
# Create .venv (once) and install weightserver with its client and dev extras, pinned by
# constraints.txt. Re-running is cheap: it reinstalls only when pyproject.toml or
# constraints.txt changed. The install log goes to .venv/install.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv with $("$PYTHON" --version)" >&2
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.weightserver-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "setup: installing weightserver[dev] into .venv (log: .venv/install.log)" >&2
  if ! .venv/bin/python -m pip install -c constraints.txt -e ".[dev]" > .venv/install.log 2>&1; then
    tail -n 40 .venv/install.log >&2
    echo "setup: pip install failed; full log in .venv/install.log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
