#!/usr/bin/env bash
# Training that does not wait for the network, and rounds that do not wait
# for the slowest, in one run; prints two markdown tables.
#
# 1. Stragglers, on loopback: bench/sync_bench in its free-running mode
#    (WORLD workers, K steps of STEP_MS simulated compute, then a blocking
#    sync; no barrier between rounds) against one coordinator, four ways:
#    no straggler (deadline mode adaptive); rank WORLD-1 FACTOR x slower with
#    the adaptive deadline, and with the fixed one (no deadline: every round
#    waits for it); and rank 1 delayed DELAY_MS once, in round 6, adaptive.
#    Columns: rank 0's mean and median wall time per round, the mean against
#    the run without a straggler, and each rank's syncs that counted.
# 2. Overlap, on the netns topology of bench/netns_scaleout.sh (every host
#    behind a RATE link, S=SHARDS coordinator replicas): the same free-running
#    mode with OV_STEP_MS steps, blocking and with --overlap (BackgroundSync,
#    merged at the next sync point); wall time per K steps against the
#    compute alone. Needs root (skipped otherwise: NETNS=0 skips it too).
#
# Usage: bench/overlap_stragglers.sh
# Environment (defaults in brackets): BUILD_DIR [<repo>/build-bench], WORLD
#   [4], MILLIONS [25], K [16], STEP_MS [50], ROUNDS [12], FACTOR [3],
#   DELAY_MS [300], OV_STEP_MS [100], OV_ROUNDS [6], SHARDS [4], RATE
#   [1gbit], NETNS [1], RUN_TIMEOUT [600], COORD_FLAGS [] (more flags of the
#   loopback runs' coordinator).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
BUILD_DIR=${BUILD_DIR:-$REPO/build-bench}
WORLD=${WORLD:-4}
MILLIONS=${MILLIONS:-25}
K=${K:-16}
STEP_MS=${STEP_MS:-50}
ROUNDS=${ROUNDS:-12}
FACTOR=${FACTOR:-3}
DELAY_MS=${DELAY_MS:-300}
OV_STEP_MS=${OV_STEP_MS:-100}
OV_ROUNDS=${OV_ROUNDS:-6}
SHARDS=${SHARDS:-4}
RATE=${RATE:-1gbit}
NETNS=${NETNS:-1}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
COORD_FLAGS=${COORD_FLAGS:-}

log() { echo "[overlap_stragglers] $*" >&2; }
die() { echo "[overlap_stragglers] error: $*" >&2; exit 1; }

if [[ ! -f $BUILD_DIR/build.ninja ]]; then
  log "configuring $BUILD_DIR (Release, no LibTorch, no tests)"
  cmake -S "$REPO" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLOCALSGD_BUILD_TORCH=OFF -DLOCALSGD_BUILD_TESTS=OFF \
    -DLOCALSGD_BUILD_PYTHON=OFF >&2
fi
ninja -C "$BUILD_DIR" localsgd-coordinator sync_bench >&2
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
BENCH=$BUILD_DIR/bench/sync_bench

tmp=$(mktemp -d)
coordinator_pid=
cleanup() {
  [[ -n $coordinator_pid ]] && kill "$coordinator_pid" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# straggler_run LABEL FLAGS...: one free-running sync_bench run against a
# fresh coordinator; appends a row to $tmp/stragglers.
straggler_run() {
  local label=$1
  shift
  rm -f "$tmp/port"
  "$COORDINATOR" --listen=127.0.0.1:0 --port_file="$tmp/port" $COORD_FLAGS \
    > "$tmp/coordinator.log" 2>&1 &
  coordinator_pid=$!
  for _ in $(seq 100); do [[ -s $tmp/port ]] && break; sleep 0.1; done
  [[ -s $tmp/port ]] || die "the coordinator did not start"
  local out
  out=$(timeout "$RUN_TIMEOUT" "$BENCH" \
    --coordinator="127.0.0.1:$(tr -d '[:space:]' < "$tmp/port")" \
    --world="$WORLD" --millions="$MILLIONS" --rounds="$ROUNDS" \
    --compute_ms="$STEP_MS" --local_steps="$K" "$@" 2> "$tmp/bench.err") ||
    { cat "$tmp/bench.err" >&2; die "sync_bench failed ($label)"; }
  kill "$coordinator_pid" 2>/dev/null || true
  wait "$coordinator_pid" 2>/dev/null || true
  coordinator_pid=
  local line
  line=$(grep '^COMPUTE ' <<< "$out")
  log "$label: $line"
  echo "$label|$line" >> "$tmp/stragglers"
}

log "stragglers: loopback, WORLD=$WORLD ${MILLIONS}M, K=$K x $STEP_MS ms, $((ROUNDS + 1)) rounds"
slow=$((WORLD - 1))
straggler_run "no straggler, adaptive" --deadline_mode=adaptive
straggler_run "rank $slow x$FACTOR slower, adaptive" --deadline_mode=adaptive \
  --straggler_rank="$slow" --straggler_factor="$FACTOR"
straggler_run "rank $slow x$FACTOR slower, fixed (no deadline)" \
  --deadline_mode=fixed --straggler_rank="$slow" --straggler_factor="$FACTOR"
straggler_run "rank 1 delayed ${DELAY_MS} ms once (round 6), adaptive" \
  --deadline_mode=adaptive --delay_rank=1 --delay_round=6 \
  --delay_ms="$DELAY_MS"

echo "### Stragglers (loopback, WORLD=$WORLD, ${MILLIONS}M fp32, K=$K x $STEP_MS ms of compute, $((ROUNDS + 1)) rounds)"
echo
echo "| run | mean s per round | median s | mean / no straggler | syncs counted per rank |"
echo "|---|---:|---:|---:|---|"
awk -F'|' '{
  label = $1; n = split($2, kv, " "); delete f
  for (i = 1; i <= n; i++) { split(kv[i], p, "="); f[p[1]] = p[2] }
  if (NR == 1) base = f["mean_s"]
  printf "| %s | %.3f | %.3f | %.2f | %s |\n", label, f["mean_s"], f["median_s"], f["mean_s"] / base, f["counted"]
}' "$tmp/stragglers"
echo
echo "Syncs counted: of $((ROUNDS + 1)) per rank (the straggler's count only while it is on time or not yet known as one)."
echo

if [[ $NETNS != 1 ]]; then
  log "NETNS=0: no overlap table"
  exit 0
fi
if [[ $(id -u) != 0 ]]; then
  log "not root: no overlap table (it needs network namespaces)"
  exit 0
fi
log "overlap: netns, $SHARDS shard(s), links $RATE, K=$K x $OV_STEP_MS ms"
for mode in blocking overlap; do
  flags="--compute_ms=$OV_STEP_MS --local_steps=$K"
  [[ $mode == overlap ]] && flags+=" --overlap"
  SHARDS=$SHARDS WIRES=float32 ROUNDS=$OV_ROUNDS PEER=0 RATE=$RATE \
    WORLD=$WORLD MILLIONS=$MILLIONS BUILD_DIR=$BUILD_DIR \
    BENCH_FLAGS="$flags" bench/netns_scaleout.sh > "$tmp/netns-$mode.log" 2>&1 ||
    { tail -20 "$tmp/netns-$mode.log" >&2; die "netns_scaleout.sh failed ($mode)"; }
  grep -o 'free-running.*' "$tmp/netns-$mode.log" | head -n 1 |
    sed "s/^/$mode|/" >> "$tmp/overlap"
  log "$mode: $(tail -n 1 "$tmp/overlap")"
done
echo "### Overlap (netns, every host link $RATE, $SHARDS coordinator shard(s), WORLD=$WORLD, ${MILLIONS}M fp32, K=$K x $OV_STEP_MS ms)"
echo
echo "| sync | mean s per K steps | median s | compute alone s | mean / compute |"
echo "|---|---:|---:|---:|---:|"
awk -F'|' '{
  mode = $1
  match($2, /median [0-9.]+/); median = substr($2, RSTART + 7, RLENGTH - 7)
  match($2, /mean [0-9.]+/); mean = substr($2, RSTART + 5, RLENGTH - 5)
  match($2, /compute alone [0-9.]+/); compute = substr($2, RSTART + 14, RLENGTH - 14)
  printf "| %s | %.3f | %.3f | %.3f | %.3f |\n", mode, mean, median, compute, mean / compute
}' "$tmp/overlap"
echo
echo "Targets: overlap <= 1.1 x compute alone; with the straggler, adaptive mean <= 1.2 x no straggler, and the delayed member's syncs all counted."
