#!/usr/bin/env bash
# The main job: one localsgd coordinator and $WORKERS Local SGD workers that
# train a CNN on Fashion-MNIST on this machine, averaging every $K steps.
#
# Usage: scripts/run-demo.sh [extra worker flags...]
#   e.g. scripts/run-demo.sh --wire_dtype=bfloat16 --lr=0.1
# Environment: BUILD_DIR (default build), WORKERS (4), K (16), EPOCHS (2),
#   EVAL_EVERY_SYNC (4), DEMO_TIMEOUT (seconds per worker, 900).
# Output: every process's lines, prefixed with [coordinator] / [worker R].
# Exit status: 0 if every worker succeeded, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
WORKERS=${WORKERS:-4}
K=${K:-16}
EPOCHS=${EPOCHS:-2}
EVAL_EVERY_SYNC=${EVAL_EVERY_SYNC:-4}
DEMO_TIMEOUT=${DEMO_TIMEOUT:-900}
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
WORKER=$BUILD_DIR/examples/localsgd-fashion-mnist

log() { echo "[demo] $*"; }
die() { echo "[demo] error: $*" >&2; exit 1; }

for bin in "$COORDINATOR" "$WORKER"; do
  [[ -x $bin ]] || die "$bin not found; build first (scripts/build.sh, or BUILD_DIR=<dir>)"
done

tmp=$(mktemp -d -t localsgd-demo.XXXXXX)
coordinator_pid=""
worker_pids=()

# Stops whatever is still running (each child leads its own process group,
# with the sed/tee that prefixes its output), then removes the temp dir.
cleanup() {
  local pid
  for pid in "${worker_pids[@]}" $coordinator_pid; do
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  for pid in "${worker_pids[@]}" $coordinator_pid; do
    for _ in $(seq 50); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "[demo] interrupted" >&2; exit 130' INT TERM

# start TAG LOGFILE CMD...: runs CMD in a new session (its pid is the process
# group id), its stdout+stderr copied to LOGFILE and printed as "[TAG] line".
# Sets STARTED_PID.
start() {
  local tag=$1 logfile=$2
  shift 2
  # shellcheck disable=SC2016  # expanded by the inner bash
  setsid bash -c 'tag=$1 logfile=$2; shift 2
    exec "$@" > >(tee "$logfile" | sed -u "s/^/[$tag] /") 2>&1' \
    _ "$tag" "$logfile" "$@" &
  STARTED_PID=$!
}

# Waits until process group $1 (a finished child and its output filters) is
# gone, so that its last lines are printed; at most 2 s.
drain() {
  for _ in $(seq 20); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.1; done
}

start coordinator "$tmp/coordinator.log" \
  "$COORDINATOR" --listen=127.0.0.1:0 --port_file="$tmp/port"
coordinator_pid=$STARTED_PID

port=""
for _ in $(seq 300); do
  if [[ -s $tmp/port ]]; then
    port=$(tr -d '[:space:]' < "$tmp/port")
    [[ $port =~ ^[0-9]+$ ]] && break
    port=""
  fi
  kill -0 "$coordinator_pid" 2>/dev/null || die "the coordinator exited before listening"
  sleep 0.1
done
[[ -n $port ]] || die "the coordinator did not write its port within 30 s"
log "coordinator listening on 127.0.0.1:$port; starting $WORKERS workers (k=$K, epochs=$EPOCHS)"

job="demo-$$"
for ((r = 0; r < WORKERS; r++)); do
  start "worker $r" "$tmp/worker$r.log" \
    timeout --signal=TERM --kill-after=10 "$DEMO_TIMEOUT" \
    "$WORKER" --coordinator="127.0.0.1:$port" --job="$job" \
    --world="$WORKERS" --rank="$r" --k="$K" --epochs="$EPOCHS" \
    --eval_every_sync="$EVAL_EVERY_SYNC" --log_every=50 "$@"
  worker_pids+=("$STARTED_PID")
done

# No start barrier is needed: the job's rendezvous (--rendezvous, default
# --world) makes the first rounds wait until every worker has joined.

failed=0
for ((r = 0; r < WORKERS; r++)); do
  rc=0
  wait "${worker_pids[r]}" || rc=$?
  drain "${worker_pids[r]}"
  if ((rc != 0)); then
    log "worker $r failed (exit status $rc)"
    failed=1
  fi
done

kill -TERM "$coordinator_pid" 2>/dev/null || true
rc=0
for _ in $(seq 300); do kill -0 "$coordinator_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$coordinator_pid" 2>/dev/null; then
  log "warning: the coordinator did not stop within 30 s of SIGTERM; killing it"
else
  wait "$coordinator_pid" || rc=$?
  drain "$coordinator_pid"
  ((rc == 0)) || log "warning: the coordinator exited with status $rc"
fi

echo
log "summary:"
for ((r = 0; r < WORKERS; r++)); do
  grep -h " final " "$tmp/worker$r.log" | sed "s/^/[demo]   /" || true
done
if ((failed)); then
  log "FAILED: at least one worker failed"
  exit 1
fi
log "OK: $WORKERS workers trained with Local SGD (k=$K)"
