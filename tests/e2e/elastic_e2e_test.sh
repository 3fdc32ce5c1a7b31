#!/usr/bin/env bash
# End-to-end, elastic membership: a job whose members come and go while it
# trains. A real coordinator (--lease_ttl=2s) and 4 real LibTorch workers
# (localsgd-fashion-mnist, k=4, chunks of 2000 elements: 14 chunks a sync):
#
#  1. workers 0 and 1 start (--rendezvous=2) and sync a few rounds;
#  2. workers 2 and 3 join the running job (--rendezvous=0); worker 2 runs only
#     --max_steps=24, so it ends early and leaves (Close's final sync, Leave);
#  3. once 2 and 3 have taken part in a round, worker 1 is SIGKILLed right as
#     a round it contributed to closes (it is then inside Sync, reading the
#     result), so the next round must drop it when its lease runs out;
#  4. workers 0 and 3 train on to --max_rounds=160 and end.
#
# Usage: elastic_e2e_test.sh COORDINATOR_BINARY WORKER_BINARY
#
# Asserts:
#  - workers 0, 2 and 3 exit 0 (worker 1 was killed);
#  - a round counted all 4 workers (the late joiners took part);
#  - the coordinator logged worker 1's lease loss, a round closed without it
#    (members_gone, dropped rank1), and worker 2's Leave;
#  - the survivors 0 and 3 reached round 80, ended in the same final round,
#    and their final parameters (last --dump_dir dump and --dump_params) are
#    byte-identical: the killed worker did not block the job;
#  - each late joiner's parameters right after joining
#    (r<rank>_init_round<R>.bin) equal worker 0's after round R
#    (r0_round<R>.bin): a late joiner starts from the job's global state;
#  - training loss fell for the survivors (last_loss < first_loss; worker 0,
#    which started from scratch, last_loss < 0.8 first_loss);
#  - the coordinator exits 0 on SIGTERM.
# On failure, prints every process's log and what failed.
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 COORDINATOR_BINARY WORKER_BINARY" >&2
  exit 2
fi
COORDINATOR=$1
WORKER=$2
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

K=4
# Rounds run at 5 to 13 a second with 4 workers on 2 cores (idle: the
# faster end) while a worker takes 2 to 3 s to start, and the two late
# joiners start one after the other: 160 rounds leave them a wide margin to
# join before the originals finish, and cost ~15 s on an idle machine. 4
# epochs of a quarter of the data: 936 steps > 160 * K.
MAX_ROUNDS=160
EPOCHS=4
CHUNK_ELEMENTS=2000
LEAVER_STEPS=24         # worker 2: 6 syncs, then the final one and Leave
LEASE_TTL=2s
RUN_TIMEOUT=${E2E_RUN_TIMEOUT:-170}  # seconds, the whole job

e2e_init elastic
e2e_require_executable "$COORDINATOR" "$WORKER"
dumps=$E2E_TMP/dumps
mkdir -p "$dumps"
run_deadline=$(($(e2e_now_us) + RUN_TIMEOUT * 1000000))
# Seconds left of RUN_TIMEOUT (at least 1).
left() {
  local s=$(((run_deadline - $(e2e_now_us)) / 1000000))
  echo $((s > 0 ? s : 1))
}

e2e_start_coordinator coordinator "$COORDINATOR" --lease_ttl="$LEASE_TTL"
coordinator_pid=$E2E_PID
port=$E2E_PORT
e2e_log "coordinator on 127.0.0.1:$port (lease $LEASE_TTL)"

declare -a pids
# start_worker RANK FLAGS...
start_worker() {
  local r=$1
  shift
  e2e_start "worker$r" "$WORKER" --coordinator="127.0.0.1:$port" \
    --job=elastic --world=4 --rank="$r" --k="$K" \
    --chunk_elements="$CHUNK_ELEMENTS" --max_rounds="$MAX_ROUNDS" \
    --dump_dir="$dumps" --dump_params="$E2E_TMP/final$r.bin" \
    --epochs="$EPOCHS" --log_every=20 --eval_every_sync=0 --eval_examples=1000 "$@"
  pids[r]=$E2E_PID
}
log() { echo "$E2E_TMP/worker$1.log"; }
sync_re() { echo "^rank=$1 sync round="; }
# last_round RANK: the round of the worker's last sync line (0 if none).
last_round() {
  local line
  line=$(e2e_last_line "$(log "$1")" "$(sync_re "$1")")
  local r
  r=$(e2e_value round "$line")
  echo "${r:-0}"
}

# 1. Two workers; the rendezvous of 2 makes round 1 wait for both.
start_worker 0 --rendezvous=2
start_worker 1 --rendezvous=2
for r in 0 1; do
  e2e_wait_count "$(log $r)" "$(sync_re $r)" 3 "$(left)" "${pids[r]}" ||
    e2e_die "worker $r did not sync 3 times"
done
e2e_log "workers 0 and 1 have synced 3 times (round $(last_round 0))"

# 2. Two late joiners, no rendezvous of their own. Worker 3 first; worker 2
#    (the short-lived leaver) only once 3 takes part, so that some rounds
#    count all four whatever the start-up times on a loaded machine.
start_worker 3 --rendezvous=0
e2e_wait_line "$(log 3)" "$(sync_re 3).* contributed=1 " "$(left)" "${pids[3]}" ||
  e2e_die "late joiner 3 never contributed to a round"
start_worker 2 --rendezvous=0 --max_steps="$LEAVER_STEPS"
e2e_wait_line "$(log 2)" "$(sync_re 2).* contributed=1 " "$(left)" "${pids[2]}" ||
  e2e_die "late joiner 2 never contributed to a round"
e2e_log "late joiners 2 and 3 have contributed (round $(last_round 3))"

# 3. Kill worker 1 as soon as worker 0 holds a round after worker 1's last
#    printed one: worker 1 contributed to that round (it was a participant)
#    and is reading its result.
round1=$(last_round 1)
deadline=$(($(e2e_now_us) + 60 * 1000000))
while (($(last_round 0) <= round1)); do
  e2e_alive "${pids[0]}" || e2e_die "worker 0 ended before worker 1 was killed"
  (($(e2e_now_us) < deadline)) || e2e_die "worker 0 did not pass round $round1 within 60 s"
  sleep 0.05
done
e2e_alive "${pids[1]}" || e2e_die "worker 1 ended before it could be killed"
kill -KILL "${pids[1]}"
e2e_log "SIGKILLed worker 1 (last printed round $(last_round 1); worker 0 at round $(last_round 0))"
rc=0
e2e_wait_exit "${pids[1]}" 10 || rc=$?
((rc == 137)) || e2e_fail "worker 1 exited with status $rc before the SIGKILL took effect (want 137)"
killed_at_round=$(last_round 0)

# 4. The rest run to the end.
for r in 0 2 3; do
  rc=0
  e2e_wait_exit "${pids[r]}" "$(left)" || rc=$?
  if ((rc == 124)); then
    e2e_fail "worker $r did not end within the run's ${RUN_TIMEOUT} s"
  elif ((rc != 0)); then
    e2e_fail "worker $r exited with status $rc"
  else
    e2e_log "worker $r exited 0 at round $(last_round "$r")"
  fi
done
e2e_stop_coordinator "$coordinator_pid"
e2e_check

# --- assertions on the logs and dumps ---
clog=$E2E_TMP/coordinator.log
grep -Eq "contributors \[rank0, rank1, rank2, rank3\]" "$clog" ||
  e2e_fail "no round counted all 4 workers (the late joiners never took part with 0 and 1)"
grep -Eq "member rank1 \([0-9a-f]+\) lost its lease" "$clog" ||
  e2e_fail "the coordinator did not log worker 1's lease loss ('member rank1 (...) lost its lease')"
grep -Eq "round [0-9]+ closed \(members_gone\).*dropped \[([a-z0-9]+, )*rank1[],]" "$clog" ||
  e2e_fail "no round closed without the killed worker 1 (members_gone, dropped [rank1])"
grep -Eq "member rank2 \([0-9a-f]+\) left;" "$clog" ||
  e2e_fail "the coordinator did not log worker 2's Leave ('member rank2 (...) left')"
grep -q "^rank=2 final " "$(log 2)" ||
  e2e_fail "worker 2 (--max_steps=$LEAVER_STEPS) printed no final line"
# Not a failure (a loaded machine may starve a heartbeat thread for a lease
# of 2 s, and the worker then joins again), but worth seeing.
if grep -Eq "member rank[023] \([0-9a-f]+\) lost its lease" "$clog"; then
  e2e_log "note: a worker other than 1 lost its lease too: $(grep -E "member rank[023] .*lost its lease" "$clog" | head -n 1)"
fi

# The survivors: same final round >= MAX_ROUNDS, identical parameters.
for r in 0 3; do
  e2e_check_survivor "$r" "$(log "$r")" "$dumps" "$MAX_ROUNDS"
done

# Late joiners start from the job's global state: their parameters right
# after joining equal worker 0's after the same round.
for r in 2 3; do
  inits=("$dumps"/r"$r"_init_round*.bin)
  init=${inits[0]}
  if [[ ! -e $init ]]; then
    e2e_fail "late joiner $r wrote no r${r}_init_round<R>.bin"
    continue
  fi
  R=${init##*_init_round}
  R=${R%.bin}
  if ((R < 1)); then
    e2e_fail "late joiner $r started from round $R, want >= 1 (it joined after rounds had closed)"
  elif [[ ! -f $dumps/r0_round$R.bin ]]; then
    e2e_fail "worker 0 has no dump of round $R to compare late joiner $r's start with"
  elif ! cmp -s "$init" "$dumps/r0_round$R.bin"; then
    e2e_fail "late joiner $r's parameters at join (state of round $R) differ from worker 0's after round $R: $(cmp "$init" "$dumps/r0_round$R.bin" 2>&1 | head -n 1)"
  else
    e2e_log "late joiner $r started from round $R's state, identical to worker 0's"
  fi
done

e2e_check_loss_fell 0 "$(log 0)" 0.8
e2e_check_loss_fell 3 "$(log 3)" 1.0
for r in 0 2 3; do e2e_last_line "$(log "$r")" "^rank=$r final "; done
e2e_check
e2e_pass "4 workers (2 joined late, 1 left, 1 SIGKILLed at round ~$killed_at_round); survivors 0 and 3 ended at round $E2E_FINAL_ROUND with identical parameters; in $(e2e_elapsed) s"
