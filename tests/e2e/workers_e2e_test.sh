#!/usr/bin/env bash
# End-to-end: a real coordinator process and 4 real LibTorch workers
# (localsgd-fashion-mnist) train for a few hundred steps with Local SGD.
#
# Usage: workers_e2e_test.sh COORDINATOR_BINARY WORKER_BINARY
#
# Asserts:
#  - every worker exits 0, each within its timeout;
#  - every worker ran the same number of syncs (max_steps / k, plus Close's);
#  - every round counted all 4 workers (contributors=4, none late);
#  - the 4 workers' final parameters (--dump_params) are byte-identical;
#  - every worker's training loss fell clearly (last_loss < 0.7 first_loss);
#  - rank 0's final test accuracy beats chance by far (> 0.5);
#  - the coordinator exits 0 on SIGTERM.
# On failure, prints every process's log and what failed.
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 COORDINATOR_BINARY WORKER_BINARY" >&2
  exit 2
fi
COORDINATOR=$1
WORKER=$2
WORKERS=4
K=8
MAX_STEPS=200
LOG_EVERY=20
WORKER_TIMEOUT=${E2E_WORKER_TIMEOUT:-300}
EXPECTED_SYNCS=$((MAX_STEPS / K + 1))

for bin in "$COORDINATOR" "$WORKER"; do
  [[ -x $bin ]] || { echo "FAIL: $bin is not an executable" >&2; exit 1; }
done

tmp=$(mktemp -d -t localsgd-e2e.XXXXXX)
coordinator_pid=""
worker_pids=()
failures=()

cleanup() {
  local pid
  for pid in "${worker_pids[@]}" $coordinator_pid; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${worker_pids[@]}" $coordinator_pid; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

fail() { failures+=("$*"); echo "FAIL: $*" >&2; }

# Prints the logs and the failures, and exits 1.
finish_failed() {
  local f
  for f in "$tmp"/*.log; do
    echo "----- ${f##*/} -----" >&2
    cat "$f" >&2
  done
  echo "===== e2e_workers FAILED:" >&2
  for f in "${failures[@]}"; do echo "  - $f" >&2; done
  exit 1
}

"$COORDINATOR" --listen=127.0.0.1:0 --port_file="$tmp/port" \
  > "$tmp/coordinator.log" 2>&1 &
coordinator_pid=$!

port=""
for _ in $(seq 300); do
  if [[ -s $tmp/port ]]; then
    port=$(tr -d '[:space:]' < "$tmp/port")
    [[ $port =~ ^[0-9]+$ ]] && break
    port=""
  fi
  if ! kill -0 "$coordinator_pid" 2>/dev/null; then
    fail "the coordinator exited before writing --port_file"
    finish_failed
  fi
  sleep 0.1
done
if [[ -z $port ]]; then
  fail "the coordinator did not write --port_file within 30 s"
  finish_failed
fi
echo "coordinator on port $port"

for ((r = 0; r < WORKERS; r++)); do
  timeout --signal=TERM --kill-after=10 "$WORKER_TIMEOUT" \
    "$WORKER" --coordinator="127.0.0.1:$port" --job=e2e \
    --world="$WORKERS" --rank="$r" --k="$K" --max_steps="$MAX_STEPS" \
    --log_every="$LOG_EVERY" --eval_every_sync=5 --eval_examples=1000 \
    --dump_params="$tmp/params$r.bin" \
    > "$tmp/worker$r.log" 2>&1 &
  worker_pids+=("$!")
done

# Workers start at different times; the job's rendezvous (--rendezvous
# defaults to --world) keeps the first round open until all have joined.
for ((r = 0; r < WORKERS; r++)); do
  rc=0
  wait "${worker_pids[r]}" || rc=$?
  if ((rc == 124)); then
    fail "worker $r timed out after ${WORKER_TIMEOUT} s"
  elif ((rc != 0)); then
    fail "worker $r exited with status $rc"
  fi
done
worker_pids=()

kill -TERM "$coordinator_pid"
rc=0
for _ in $(seq 300); do kill -0 "$coordinator_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$coordinator_pid" 2>/dev/null; then
  fail "the coordinator did not exit within 30 s of SIGTERM"
else
  wait "$coordinator_pid" || rc=$?
  coordinator_pid=""
  ((rc == 0)) || fail "the coordinator exited with status $rc after SIGTERM"
fi
((${#failures[@]} == 0)) || finish_failed

# value KEY LINE: the value of KEY=... in LINE.
value() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<< "$2"; }

for ((r = 0; r < WORKERS; r++)); do
  log=$tmp/worker$r.log
  final=$(grep "^rank=$r final " "$log" || true)
  if [[ -z $final ]]; then
    fail "worker $r printed no final line"
    continue
  fi
  echo "$final"
  first=$(value first_loss "$final")
  last=$(value last_loss "$final")
  if ! awk -v f="$first" -v l="$last" 'BEGIN { exit !(f > 0 && l < 0.7 * f) }'; then
    fail "worker $r: training loss did not fall clearly: first_loss=$first last_loss=$last (want last < 0.7 first)"
  fi
  rounds=$(value rounds "$final")
  ((rounds == EXPECTED_SYNCS)) ||
    fail "worker $r: $rounds syncs, want $EXPECTED_SYNCS ($MAX_STEPS steps / k=$K, plus the final sync)"
  syncs=$(grep -c "^rank=$r sync " "$log" || true)
  ((syncs == EXPECTED_SYNCS)) ||
    fail "worker $r: $syncs sync lines, want $EXPECTED_SYNCS"
  partial=$(grep "^rank=$r sync " "$log" | grep -v "contributed=1 late=0 contributors=$WORKERS bytes_sent=[0-9]* bytes_received=[0-9]* rejoined=0\$" || true)
  [[ -z $partial ]] ||
    fail "worker $r: rounds without all $WORKERS workers: $(head -n 3 <<< "$partial" | tr '\n' ';')"
  if [[ ! -s $tmp/params$r.bin ]]; then
    fail "worker $r wrote no --dump_params file"
  elif ((r > 0)) && ! cmp -s "$tmp/params0.bin" "$tmp/params$r.bin"; then
    fail "worker $r's final parameters differ from worker 0's: $(cmp "$tmp/params0.bin" "$tmp/params$r.bin" 2>&1 | head -n 1)"
  fi
done

final0=$(grep "^rank=0 final " "$tmp/worker0.log" || true)
accuracy=$(value test_accuracy "$final0")
if ! awk -v a="${accuracy:-0}" 'BEGIN { exit !(a > 0.5) }'; then
  fail "rank 0's final test accuracy is ${accuracy:-missing}, want > 0.5"
fi

((${#failures[@]} == 0)) || finish_failed
echo "PASS: $WORKERS workers, $EXPECTED_SYNCS syncs each, identical final parameters ($(stat -c %s "$tmp/params0.bin") bytes), test_accuracy=$accuracy"
