#!/usr/bin/env bash
# Start a Docker engine unless one already answers: `dockerd --storage-driver=vfs` in the
# background (vfs works on any filesystem, including inside a container), logging to
# $DOCKERD_LOG. Prints the PID of the dockerd it started, nothing if one was running, so the
# caller can stop only what it started.
set -euo pipefail
LOG=${DOCKERD_LOG:-/tmp/dockerd.log}
if docker info >/dev/null 2>&1; then
    exit 0
fi
command -v dockerd >/dev/null || { echo "dockerd not found: apt-get install docker.io" >&2; exit 1; }
# setsid: a session of its own, so a Ctrl-C meant for the caller does not reach the engine.
setsid dockerd --storage-driver="${DOCKERD_STORAGE_DRIVER:-vfs}" >"$LOG" 2>&1 </dev/null &
pid=$!
for _ in $(seq 120); do
    if docker info >/dev/null 2>&1; then
        echo "$pid"
        exit 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "dockerd exited; its log, $LOG:" >&2; tail -20 "$LOG" >&2; exit 1; }
    sleep 0.5
done
echo "dockerd did not answer within 60 s; its log is $LOG" >&2
kill "$pid"
exit 1
