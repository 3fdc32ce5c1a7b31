#!/usr/bin/env bash
# Does Local SGD really train? Runs the example worker
# (localsgd-fashion-mnist) with $WORKERS workers, the same seed and the same
# samples per worker ($EPOCHS passes over its shard), as synchronous
# training (K=1), Local SGD (K in $KS) and no averaging (--no_sync), one
# run after the other against one coordinator, and prints a markdown table:
# rank 0's final test accuracy and loss (all workers hold the same
# parameters after the final sync; without averaging, rank 0's own model),
# the run's wall time, and the bytes of parameters each worker sent.
#
# Usage:
#   bench/convergence.sh            # the README table: K=1,4,16,64 + none
#   bench/convergence.sh --check    # the ctest: K=8 vs K=1 vs none; fails
#                                   # unless loss(K=8) <= loss(K=1) + MARGIN
#                                   # and loss(K=8) < loss(none)
#   bench/convergence.sh --overlap  # K=$OVERLAP_K with and without the
#                                   # worker's --overlap, for each seed in
#                                   # $SEEDS ("1 2 3"): the accuracies side
#                                   # by side, their means and the gap
#                                   # (target: within 0.5 points)
# Environment: BUILD_DIR (build), WORKERS (4), EPOCHS (1), SEED (1),
#   KS ("1 4 16 64"; --check: "1 8"), MARGIN (0.07 test loss: the gap seen
#   here is 0.02-0.03 with run-to-run noise up to 0.015, while no averaging
#   trails by 0.12), extra worker flags in WORKER_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=0
OVERLAP=0
if [[ ${1:-} == --check ]]; then CHECK=1; fi
if [[ ${1:-} == --overlap ]]; then OVERLAP=1; fi
SEEDS=${SEEDS:-1 2 3}
OVERLAP_K=${OVERLAP_K:-16}
BUILD_DIR=${BUILD_DIR:-build}
WORKERS=${WORKERS:-4}
EPOCHS=${EPOCHS:-1}
SEED=${SEED:-1}
MARGIN=${MARGIN:-0.07}
if ((CHECK)); then KS=${KS:-"1 8"}; else KS=${KS:-"1 4 16 64"}; fi
WORKER_FLAGS=${WORKER_FLAGS:-}
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
WORKER=$BUILD_DIR/examples/localsgd-fashion-mnist

log() { echo "[convergence] $*" >&2; }
die() { echo "[convergence] error: $*" >&2; exit 1; }
for bin in "$COORDINATOR" "$WORKER"; do
  [[ -x $bin ]] || die "$bin not found; build first (BUILD_DIR=<dir>)"
done
[[ -d /usr/share/datasets/fashion-mnist ]] ||
  { log "skipped: dataset-fashion-mnist is not installed"; exit 77; }

tmp=$(mktemp -d -t localsgd-convergence.XXXXXX)
pids=()
coordinator_pid=""
cleanup() {
  local pid
  for pid in "${pids[@]}" $coordinator_pid; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# No metrics endpoint (its default port would clash between runs), where
# the coordinator has one.
coordinator_flags=(--listen=127.0.0.1:0 --port_file="$tmp/port")
if "$COORDINATOR" --help 2>&1 | grep -q -- --metrics_listen; then
  coordinator_flags+=(--metrics_listen=)
fi
"$COORDINATOR" "${coordinator_flags[@]}" \
  > "$tmp/coordinator.log" 2>&1 &
coordinator_pid=$!
for _ in $(seq 300); do
  [[ -s $tmp/port ]] && break
  kill -0 "$coordinator_pid" 2>/dev/null || die "the coordinator exited"
  sleep 0.1
done
port=$(tr -d '[:space:]' < "$tmp/port")

# field NAME LINE: the value of NAME=... in LINE.
field() { grep -o "$1=[^ ]*" <<< "$2" | head -n 1 | cut -d= -f2; }

# run NAME FLAGS...: one run of $WORKERS workers; sets RESULT to
# "accuracy loss seconds bytes_per_worker".
run() {
  local name=$1
  shift
  local start end r rc=0 bytes=0 line
  pids=()
  start=${EPOCHREALTIME/./}
  for ((r = 0; r < WORKERS; r++)); do
    # shellcheck disable=SC2086  # WORKER_FLAGS: several flags
    "$WORKER" --coordinator="127.0.0.1:$port" --job="conv-$name-$$" \
      --world="$WORKERS" --rank="$r" --epochs="$EPOCHS" --seed="$SEED" \
      --eval_every_sync=0 --log_every=50 $WORKER_FLAGS "$@" \
      > "$tmp/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < WORKERS; r++)); do
    wait "${pids[r]}" || rc=1
  done
  end=${EPOCHREALTIME/./}
  pids=()
  if ((rc)); then
    tail -n 5 "$tmp/$name".*.log >&2
    die "run $name: a worker failed"
  fi
  for ((r = 0; r < WORKERS; r++)); do
    line=$(grep -h "^rank=$r final " "$tmp/$name.$r.log")
    bytes=$((bytes + $(field bytes_sent "$line")))
  done
  line=$(grep -h "^rank=0 final " "$tmp/$name.0.log")
  RESULT="$(field test_accuracy "$line") $(field test_loss "$line") \
$(awk -v us=$((end - start)) 'BEGIN { printf "%.1f", us / 1e6 }') $((bytes / WORKERS))"
  log "$name: accuracy loss seconds bytes/worker = $RESULT"
}

declare -A ACC LOSS SECS BYTES
if ((OVERLAP)); then
  rows=()
  for SEED in $SEEDS; do
    run "s$SEED-blocking" --k="$OVERLAP_K"
    read -r a1 l1 t1 _ <<< "$RESULT"
    run "s$SEED-overlap" --k="$OVERLAP_K" --overlap
    read -r a2 l2 t2 _ <<< "$RESULT"
    rows+=("$SEED $a1 $a2 $l1 $l2 $t1 $t2")
  done
  echo "| seed | accuracy, blocking | accuracy, overlap | loss, blocking | loss, overlap | wall s, blocking | wall s, overlap |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}" | awk '{
    printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7
    n++; a1 += $2; a2 += $3; l1 += $4; l2 += $5 }
    END {
      printf "| mean | %.4f | %.4f | %.4f | %.4f | | |\n", a1 / n, a2 / n, l1 / n, l2 / n
      gap = (a2 - a1) / n * 100
      printf "\noverlap - blocking: %+.2f points of test accuracy (target: within 0.5 points): %s\n", gap, (gap >= -0.5 ? "met" : "NOT met")
    }'
  echo
  echo "$WORKERS workers, K=$OVERLAP_K, $EPOCHS epoch(s) over each worker's shard, seeds $SEEDS, $(nproc) cores."
  exit 0
fi
names=()
for k in $KS; do
  run "k$k" --k="$k"
  read -r "ACC[k$k]" "LOSS[k$k]" "SECS[k$k]" "BYTES[k$k]" <<< "$RESULT"
  names+=("k$k")
done
run none --no_sync --k=16
read -r "ACC[none]" "LOSS[none]" "SECS[none]" "BYTES[none]" <<< "$RESULT"
names+=(none)

echo "| run | final test accuracy | final test loss | wall time (s) | bytes sent per worker |"
echo "|---|---|---|---|---|"
for name in "${names[@]}"; do
  case $name in
    k1) label="synchronous (K=1)" ;;
    none) label="no averaging" ;;
    *) label="Local SGD (K=${name#k})" ;;
  esac
  printf '| %s | %s | %s | %s | %s |\n' "$label" "${ACC[$name]}" \
    "${LOSS[$name]}" "${SECS[$name]}" "${BYTES[$name]}"
done
echo
echo "$WORKERS workers, $EPOCHS epoch(s) over each worker's shard, seed $SEED, $(nproc) cores."

if ((CHECK)); then
  awk -v local="${LOSS[k8]}" -v sync="${LOSS[k1]}" -v none="${LOSS[none]}" \
      -v margin="$MARGIN" 'BEGIN {
    ok = 1
    if (!(local <= sync + margin)) {
      printf "FAIL: Local SGD (K=8) test loss %s is not within %s of synchronous (K=1) %s\n", local, margin, sync
      ok = 0
    }
    if (!(local < none)) {
      printf "FAIL: Local SGD (K=8) test loss %s is not below no averaging %s\n", local, none
      ok = 0
    }
    if (ok) printf "OK: K=8 loss %s within %s of K=1 (%s) and below no averaging (%s)\n", local, margin, sync, none
    exit ok ? 0 : 1
  }'
fi
