#!/usr/bin/env bash
# Runs docker/compose.yaml for real, as CI does: starts a Docker engine if none answers, builds
# the image once (on the air-gapped base image when Docker Hub cannot be reached), runs the stack
# with `up --exit-code-from trainer` for DEMO_SECONDS (default 25), and checks that every
# container exited 0, that both collectors ended on the trainer's final version, that the server
# logged and served metrics, and that the versions survive a server restart in the weights
# volume. Then the two-level tree, docker/compose.tree.yaml (a primary, 2 relays, 2 collectors
# on each), for DEMO_SECONDS too (the trainer's clock starts at its first batch, however long
# the containers take to start): every container exits 0, and all 4 collectors end on the final
# version, having fetched over their relay's shared memory. `down -v` at the end, also on failure; a dockerd it
# started is stopped, the images stay (later runs reuse their layers). Logs go to $STACK_LOGS
# (default /tmp/weightserver-stack).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEMO_SECONDS=${DEMO_SECONDS:-25}
LOGS=${STACK_LOGS:-/tmp/weightserver-stack}
AIR_GAPPED_BASE=weightserver-base:bookworm-py311
COMPOSE=(docker-compose -f docker/compose.yaml)
TREE=(docker-compose -p weightserver-tree -f docker/compose.tree.yaml)
mkdir -p "$LOGS"

phase_start=$SECONDS
phase() {
    echo "run-stack: $1 ($((SECONDS - phase_start)) s)"
    phase_start=$SECONDS
}

dockerd_pid=$(DOCKERD_LOG="$LOGS/dockerd.log" bash docker/start-dockerd.sh)
cleanup() {
    local status=$?
    if ((status)); then
        echo "run-stack: FAILED; the last log lines of each service:" >&2
        "${COMPOSE[@]}" logs --no-color --tail=30 >&2 || true
        "${TREE[@]}" logs --no-color --tail=30 >&2 || true
    fi
    "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || echo "run-stack: down -v failed" >&2
    "${TREE[@]}" down -v --remove-orphans >/dev/null 2>&1 || echo "run-stack: down -v (tree) failed" >&2
    if [[ -n $dockerd_pid ]]; then
        kill "$dockerd_pid"
        while kill -0 "$dockerd_pid" 2>/dev/null; do sleep 0.5; done
    fi
    exit "$status"
}
trap cleanup EXIT
phase "Docker engine up${dockerd_pid:+ (started dockerd, pid $dockerd_pid)}"

if [[ -z ${BASE_IMAGE:-} ]]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 120 docker pull -q python:3.11-slim; then
        export BASE_IMAGE=python:3.11-slim
    else
        echo "run-stack: Docker Hub unreachable: the air-gapped base image $AIR_GAPPED_BASE"
        BASE_IMAGE_TAG=$AIR_GAPPED_BASE bash docker/base/build-base-image.sh
        export BASE_IMAGE=$AIR_GAPPED_BASE TORCH_INDEX_URL=${TORCH_INDEX_URL-}
    fi
fi
phase "base image $BASE_IMAGE"

"${COMPOSE[@]}" build >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
phase "image built (log: $LOGS/build.log)"
# The earlier builds this one untagged: on vfs each is a full copy of every layer (about 1.4 GB
# per layer), and the tree's 8 containers need about 11 GB more (each a copy of the image).
docker image prune -f --filter label=io.weightserver.image=demo >/dev/null

"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1  # volumes of an earlier run
"${COMPOSE[@]}" up --no-color --exit-code-from trainer 2>&1 | tee "$LOGS/up.log"
phase "stack ran: trainer exited 0 after DEMO_SECONDS=$DEMO_SECONDS"

# ended SUMMARY COLLECTORS TRANSPORT COMPOSE...: every container of the stack exited 0, and the
# trainer's summary (copied to SUMMARY) has COLLECTORS collectors on its final version, an empty
# spool, and every fetch over TRANSPORT when one is named. Prints the final version.
ended() {
    local summary=$1 collectors=$2 transport=$3 failed=0 container name code
    shift 3
    for container in $("$@" ps -q); do
        read -r name code < <(docker inspect -f '{{.Name}} {{.State.ExitCode}}' "$container")
        echo "run-stack: $name exited $code" >&2
        [[ $code == 0 ]] || failed=1
    done
    ((failed == 0)) || { echo "run-stack: a container exited non-zero (see above and $LOGS)" >&2; return 1; }
    docker cp "$("$@" ps -q trainer):/spool/summary.json" "$summary"
    python3 - "$summary" "$collectors" "$transport" <<'EOF'
import json, sys
summary, collectors, transport = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
final = summary["final_version"]
reports = list(summary["collectors"].values())
finals = sorted(report["final_version"] for report in reports)
if finals != [final] * collectors or not summary["spool_empty"]:
    sys.exit(f"run-stack: expected {collectors} collectors on the final version v{final}, spool empty: {finals}, spool_empty {summary['spool_empty']}")
used = {name for report in reports for name in report["transports"]}
if transport and used != {transport}:
    sys.exit(f"run-stack: expected every fetch over {transport}, the collectors used {sorted(used)}")
print(final)
EOF
}

final=$(ended "$LOGS/summary.json" 2 "" "${COMPOSE[@]}")
echo "run-stack: both collectors ended on the trainer's final version v$final"
"${COMPOSE[@]}" logs --no-color weightserver >"$LOGS/weightserver.log"
grep -q "publish model=policy" "$LOGS/weightserver.log" ||
    { echo "run-stack: the server logged no publish ($LOGS/weightserver.log; log level?)" >&2; exit 1; }

# The versions survive a server restart in the weights volume: start the server again and ask.
"${COMPOSE[@]}" start weightserver
server=$("${COMPOSE[@]}" ps -q weightserver)
for _ in $(seq 60); do
    health=$(docker inspect -f '{{.State.Health.Status}}' "$server")
    [[ $health == healthy ]] && break
    sleep 1
done
[[ $health == healthy ]] || { echo "run-stack: the restarted server is $health after 60 s" >&2; exit 1; }
latest=$("${COMPOSE[@]}" exec -T weightserver weightserver ls --json |
    python3 -c 'import json, sys; print({m["model"]: m["latest_version"] for m in json.load(sys.stdin)}["policy"])')
[[ $latest == "$final" ]] || { echo "run-stack: after a restart the server holds v$latest, not v$final" >&2; exit 1; }
metric=$("${COMPOSE[@]}" exec -T weightserver python -c \
    'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9100/metrics").read().decode())' |
    sed -n 's/^weightserver_latest_version{model="policy"} //p')
[[ $metric == "$final.0" ]] || { echo "run-stack: metrics say latest version '$metric', not $final" >&2; exit 1; }
phase "restarted server holds v$final (weightserver ls, and metrics on port 9100)"
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1

"${TREE[@]}" down -v --remove-orphans >/dev/null 2>&1  # volumes of an earlier run
"${TREE[@]}" up --no-color --exit-code-from trainer 2>&1 | tee "$LOGS/tree-up.log"
final=$(ended "$LOGS/tree-summary.json" 4 shm "${TREE[@]}")
for relay in relay-a relay-b; do
    # grep reads it all: `grep -q` stops at the first match, and under pipefail the writer's SIGPIPE
    # then failed the check although the line was there.
    "${TREE[@]}" logs --no-color "$relay" | grep -F "relay model=policy version=$final " >/dev/null ||
        { echo "run-stack: $relay did not relay v$final ($LOGS/tree-up.log)" >&2; exit 1; }
done
phase "tree ran: 4 collectors ended on v$final, fetched over their relay's shared memory, both relays relayed it"
echo "run-stack: OK"
