#!/usr/bin/env bash
# The main job: one localsgd coordinator and $WORKERS Local SGD workers that
# train a CNN on Fashion-MNIST on this machine, averaging every $K steps.
#
# Usage: scripts/run-demo.sh [extra worker flags...]
#   e.g. scripts/run-demo.sh --wire_dtype=bfloat16 --lr=0.1
# Environment: BUILD_DIR (default build), WORKERS (4), K (16), EPOCHS (2),
#   EVAL_EVERY_SYNC (4), DEMO_TIMEOUT (seconds per worker, 900),
#   PYTHON_WORKERS (0): how many of the workers (ranks 0..N-1) run the Python
#   twin, examples/fashion_mnist.py (localsgd.LocalSGD on PyTorch), in the
#   same job as the C++ ones.
# Output: a compact view (a progress bar per worker, a line per round), then a
#   summary table and a plot (training.png) next to the logs, whose folder
#   is printed (LOG_DIR sets it). VIEW=logs prints every process's lines
#   instead, prefixed with [coordinator] / [worker R] (scripts/launch-lib.sh).
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

LAUNCH_TAG=demo
# shellcheck source=scripts/launch-lib.sh
source scripts/launch-lib.sh

start_coordinator
log "coordinator listening on 127.0.0.1:$port; starting $WORKERS workers (k=$K, epochs=$EPOCHS)"

PYTHON_WORKERS=${PYTHON_WORKERS:-0}
((PYTHON_WORKERS >= 0 && PYTHON_WORKERS <= WORKERS)) ||
  die "PYTHON_WORKERS=$PYTHON_WORKERS: expected 0..$WORKERS"
if ((PYTHON_WORKERS > 0)); then
  [[ -f $BUILD_DIR/python/localsgd/__init__.py ]] ||
    die "the Python package is not built in $BUILD_DIR/python (pybind11-dev, python3-dev)"
fi
job="demo-$$"
labels=""
for ((r = 0; r < WORKERS; r++)); do
  if ((r < PYTHON_WORKERS)); then
    program=(env "PYTHONPATH=$BUILD_DIR/python" /usr/bin/python3 examples/fashion_mnist.py)
    labels+="worker $r py,"
  else
    program=("$WORKER")
    labels+="worker $r,"
  fi
  start "worker $r" "$tmp/worker$r.log" \
    timeout --signal=TERM --kill-after=10 "$DEMO_TIMEOUT" \
    "${program[@]}" --coordinator="127.0.0.1:$port" --job="$job" \
    --world="$WORKERS" --rank="$r" --k="$K" --epochs="$EPOCHS" \
    --eval_every_sync="$EVAL_EVERY_SYNC" --log_every=10 "$@"
  worker_pids+=("$STARTED_PID")
done
what="$WORKERS workers"
if ((PYTHON_WORKERS > 0)); then what="$WORKERS workers ($PYTHON_WORKERS in Python)"; fi
show_run "$job" "localsgd demo: $what, Fashion-MNIST, K=$K, $EPOCHS epochs" "$labels"

# No start barrier is needed: the job's rendezvous (--rendezvous, default
# --world) makes the first rounds wait until every worker has joined.

wait_workers
stop_coordinator
print_finals
if ((failed)); then
  log "FAILED: at least one worker failed"
  exit 1
fi
log "OK: $WORKERS workers trained with Local SGD (k=$K)"
