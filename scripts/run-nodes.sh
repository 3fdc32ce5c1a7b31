#!/usr/bin/env bash
# Node-local averaging on this machine: one localsgd coordinator and $NODES
# "nodes" of $PROCS worker processes each. The processes of a node average
# among themselves over a c10d Gloo group (NCCL with --device=cuda where
# LibTorch has it); only each node's local rank 0 joins the job, with
# weight $PROCS. Global rank = node * PROCS + local rank, world = NODES *
# PROCS (the data shards), as torchrun numbers them; the environment is
# torchrun's (LOCAL_RANK, LOCAL_WORLD_SIZE) plus LOCALSGD_NODE_STORE.
#
# Usage: scripts/run-nodes.sh [extra worker flags...]
# Environment: BUILD_DIR (default build), NODES (2), PROCS (2), K (16),
#   EPOCHS (1), EVAL_EVERY_SYNC (0), RUN_TIMEOUT (seconds per worker, 900).
# Output: as scripts/run-demo.sh's (a compact view, a summary, a plot; VIEW=logs
#   for every process's lines, prefixed with [coordinator] / [node N.L]).
# Exit status: 0 if every worker succeeded, 1 otherwise.
#
# If a node's leader dies, the node's other processes fail at their next
# sync (ABORTED, "restart the whole node") and the coordinator drops the
# node when the leader's lease runs out; a restarted node (all M processes,
# as torchrun restarts them) re-joins the job as a late joiner.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
NODES=${NODES:-2}
PROCS=${PROCS:-2}
K=${K:-16}
EPOCHS=${EPOCHS:-1}
EVAL_EVERY_SYNC=${EVAL_EVERY_SYNC:-0}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
WORKER=$BUILD_DIR/examples/localsgd-fashion-mnist

LAUNCH_TAG=nodes
# shellcheck source=scripts/launch-lib.sh
source scripts/launch-lib.sh
((NODES >= 1 && PROCS >= 1)) || die "NODES and PROCS must be >= 1"

# A free loopback TCP port (the kernel's choice), for a node's store.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_coordinator

world=$((NODES * PROCS))
labels=""
job="nodes-$$"
log "coordinator on 127.0.0.1:$port; $NODES nodes x $PROCS processes (world=$world, k=$K, epochs=$EPOCHS)"
for ((n = 0; n < NODES; n++)); do
  store="127.0.0.1:$(free_port)"
  for ((l = 0; l < PROCS; l++)); do
    r=$((n * PROCS + l))
    start "node $n.$l" "$tmp/worker$r.log" \
      env LOCAL_RANK=$l LOCAL_WORLD_SIZE="$PROCS" LOCALSGD_NODE_STORE="$store" \
      timeout --signal=TERM --kill-after=10 "$RUN_TIMEOUT" \
      "$WORKER" --coordinator="127.0.0.1:$port" --job="$job" \
      --world="$world" --rank="$r" --k="$K" --epochs="$EPOCHS" \
      --eval_every_sync="$EVAL_EVERY_SYNC" --log_every=10 "$@"
    worker_pids+=("$STARTED_PID")
    labels+="node $n.$l,"
  done
done
show_run "$job" "localsgd nodes: $NODES nodes x $PROCS processes, K=$K, $EPOCHS epochs" "$labels"

wait_workers
stop_coordinator
print_finals
if [[ $VIEW == logs ]]; then
  grep -h "round .* closed" "$tmp/coordinator.log" | tail -n 1 | sed "s/^/[nodes]   /" || true
fi
if ((failed)); then
  log "FAILED: at least one worker failed"
  exit 1
fi
log "OK: $NODES nodes x $PROCS processes trained with node-local averaging + Local SGD (k=$K)"
