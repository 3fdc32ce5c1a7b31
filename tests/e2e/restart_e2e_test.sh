#!/usr/bin/env bash
# End-to-end, coordinator restart: the coordinator checkpoints its jobs to
# --state_dir when a round closes and restores them when it starts. A real
# coordinator (--lease_ttl=2s, --state_dir) and 3 real LibTorch workers
# (localsgd-fashion-mnist, k=4, --max_rounds=30) train; once round 5 has
# closed and a checkpoint of it (or a later round) is written, the
# coordinator is SIGKILLed (workers sync constantly, so most
# likely in the middle of a round) and started again on the same port with
# the same --state_dir. The workers ride it out: their Syncs retry
# UNAVAILABLE, then join again (Client::Sync) and carry on.
#
# Usage: restart_e2e_test.sh COORDINATOR_BINARY WORKER_BINARY
#
# Asserts:
#  - every worker exits 0 and reaches round 30, all in the same final round,
#    with byte-identical final parameters (last --dump_dir dump and
#    --dump_params);
#  - the SIGKILL comes once a checkpoint of round >= 5 is on disk; the
#    restarted coordinator restores a round in [5, the last round the first
#    one closed] and its first closed round is the next one: round numbering
#    resumed from the checkpoint instead of starting over from 1 (a re-seed);
#  - no worker's sync rounds went backwards, but once to the restored round
#    from a round closed after the last checkpoint (which the SIGKILL lost);
#  - the workers noticed the restart: at least one printed rejoined=1 or a
#    skipped sync, and the restarted coordinator logged their joins, each
#    within a lease (2 s) of serving;
#  - --state_dir is not empty; training loss fell (last < 0.8 first);
#  - the restarted coordinator exits 0 on SIGTERM.
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

WORKERS=3
K=4
MAX_ROUNDS=30
KILL_AFTER_ROUND=5
LEASE_TTL=2s
RUN_TIMEOUT=${E2E_RUN_TIMEOUT:-170}  # seconds, the whole job

e2e_init restart
e2e_require_executable "$COORDINATOR" "$WORKER"
dumps=$E2E_TMP/dumps
state=$E2E_TMP/state
mkdir -p "$dumps" "$state"
run_deadline=$(($(e2e_now_us) + RUN_TIMEOUT * 1000000))
left() {
  local s=$(((run_deadline - $(e2e_now_us)) / 1000000))
  echo $((s > 0 ? s : 1))
}

# start_coordinator NAME ADDRESS: a coordinator listening on ADDRESS with the test's
# --state_dir; sets E2E_PID and E2E_PORT. Says so if the binary does not know
# --state_dir (the flag this test is about).
start_coordinator() {
  local name=$1 address=$2
  rm -f "$E2E_TMP/$name.port"
  # GLOG_vmodule: the checkpointer's "checkpointed job J at round R" lines,
  # which the test waits on before the SIGKILL.
  GLOG_vmodule=checkpointer=1 e2e_start "$name" "$COORDINATOR" --listen="$address" \
    --port_file="$E2E_TMP/$name.port" --state_dir="$state" \
    --lease_ttl="$LEASE_TTL"
  local pid=$E2E_PID
  local deadline=$(($(e2e_now_us) + 30 * 1000000))
  while [[ ! -s $E2E_TMP/$name.port ]]; do
    if ! e2e_alive "$pid"; then
      if grep -q "flag 'state_dir'" "$E2E_TMP/$name.log"; then
        e2e_die "$name refused --state_dir=$state (is the flag implemented?): $(head -n 3 "$E2E_TMP/$name.log" | tr '\n' ' ')"
      fi
      return 1
    fi
    (($(e2e_now_us) < deadline)) || e2e_die "$name did not write its --port_file within 30 s"
    sleep 0.1
  done
  e2e_wait_port_file "$E2E_TMP/$name.port" "$pid" 5
  E2E_PID=$pid
}

start_coordinator coordinator1 127.0.0.1:0 ||
  e2e_die "the coordinator exited before serving"
coordinator_pid=$E2E_PID
port=$E2E_PORT
e2e_log "coordinator on 127.0.0.1:$port (lease $LEASE_TTL, state dir $state)"

declare -a pids
for ((r = 0; r < WORKERS; r++)); do
  e2e_start "worker$r" "$WORKER" --coordinator="127.0.0.1:$port" \
    --job=restart --world="$WORKERS" --rank="$r" --k="$K" \
    --max_rounds="$MAX_ROUNDS" --dump_dir="$dumps" \
    --dump_params="$E2E_TMP/final$r.bin" \
    --log_every=20 --eval_every_sync=0 --eval_examples=1000
  pids[r]=$E2E_PID
done
log() { echo "$E2E_TMP/worker$1.log"; }
# rounds RANK: the rounds of the worker's sync lines, one a line.
rounds() { sed -n "s/^rank=$1 sync round=\([0-9]*\) .*/\1/p" "$(log "$1")"; }
# closed_rounds LOG: the rounds a coordinator log says closed, in order.
closed_rounds() { sed -n 's/.*: round \([0-9]*\) closed (.*/\1/p' "$1"; }

clog1=$E2E_TMP/coordinator1.log
clog2=$E2E_TMP/coordinator2.log
e2e_wait_line "$clog1" ": round $KILL_AFTER_ROUND closed " "$(left)" "$coordinator_pid" ||
  e2e_die "round $KILL_AFTER_ROUND never closed on the first coordinator"
# Checkpoints are written in the background after a round closes (and a newer
# state replaces one still queued), so wait until one of round
# >= KILL_AFTER_ROUND is on disk: the SIGKILL then proves what survives one.
e2e_wait_line "$clog1" "checkpointed job restart at round ([5-9]|[1-9][0-9]+)$" "$(left)" "$coordinator_pid" ||
  e2e_die "no checkpoint of round >= $KILL_AFTER_ROUND was written by the first coordinator"
kill -KILL "$coordinator_pid"
rc=0
e2e_wait_exit "$coordinator_pid" 10 || rc=$?
((rc == 137)) || e2e_fail "the first coordinator exited with status $rc, not by the SIGKILL (137)"
last_closed_1=$(closed_rounds "$clog1" | tail -n 1)
e2e_log "SIGKILLed the coordinator after round $last_closed_1 closed"

# The same port and --state_dir. Retry a few times should the port be taken
# for a moment (a reconnecting client's ephemeral port).
started=0
for attempt in 1 2 3 4 5; do
  if start_coordinator coordinator2 "127.0.0.1:$port"; then
    started=1
    break
  fi
  e2e_log "restart attempt $attempt failed: $(tail -n 1 "$clog2")"
  cp "$clog2" "$E2E_TMP/coordinator2-attempt$attempt.log"
  sleep 0.5  # back off before retrying the bind (not a synchronisation)
done
((started)) || e2e_die "the coordinator could not be restarted on port $port"
coordinator_pid=$E2E_PID
e2e_log "coordinator restarted on 127.0.0.1:$port"

for ((r = 0; r < WORKERS; r++)); do
  rc=0
  e2e_wait_exit "${pids[r]}" "$(left)" || rc=$?
  if ((rc == 124)); then
    e2e_fail "worker $r did not end within the run's ${RUN_TIMEOUT} s"
  elif ((rc != 0)); then
    e2e_fail "worker $r exited with status $rc"
  fi
done
e2e_stop_coordinator "$coordinator_pid"
e2e_check

# --- assertions ---
first_closed_2=$(closed_rounds "$clog2" | head -n 1)
restored=$(sed -n 's/.*restored job restart at round \([0-9]*\) .*/\1/p' "$clog2" | head -n 1)
if [[ -z $restored ]]; then
  e2e_fail "the restarted coordinator did not log restoring job restart from $state"
elif ((restored < KILL_AFTER_ROUND || restored > last_closed_1)); then
  e2e_fail "the restarted coordinator restored round $restored, want one in [$KILL_AFTER_ROUND, $last_closed_1]: a checkpoint of round >= $KILL_AFTER_ROUND was on disk and the first coordinator closed no round after $last_closed_1"
fi
if [[ -z $first_closed_2 ]]; then
  e2e_fail "the restarted coordinator closed no round"
elif [[ -n $restored ]] && ((first_closed_2 != restored + 1)); then
  e2e_fail "the restarted coordinator's first closed round is $first_closed_2, want $((restored + 1)) (the round after the restored $restored): round numbering did not resume from the checkpoint in --state_dir"
else
  # Rounds closed after the newest checkpoint on disk are lost to a SIGKILL
  # (checkpoints are written in the background); their members adopt the
  # restored state when they join again.
  e2e_log "first coordinator closed rounds up to $last_closed_1, restored round $restored; the restarted one went on with round $first_closed_2"
fi
if grep -q "seeded by" "$clog2"; then
  e2e_fail "the restarted coordinator's job was seeded again: it did not restore the job's state ($(grep -m 1 "seeded by" "$clog2"))"
fi
[[ -n $(ls -A "$state") ]] || e2e_fail "--state_dir $state is empty"

# Every worker must be back within a lease of the restarted coordinator
# serving: the restart itself takes well under a second, and a member that
# stays away longer finds the job gone on without it.
# glog_s LINE: the seconds of the day of a glog line (I20261129 19:14:18.56).
glog_s() { awk '{ split($2, t, ":"); printf "%.3f", t[1] * 3600 + t[2] * 60 + t[3] }' <<< "$1"; }
serving_line=$(grep -m 1 "coordinator listening on" "$clog2" || true)
lease_s=${LEASE_TTL%s}
if [[ -n $serving_line ]]; then
  serving_s=$(glog_s "$serving_line")
  for ((r = 0; r < WORKERS; r++)); do
    join_line=$(grep -E -m 1 "member rank$r \([0-9a-f]+, weight [0-9.]+\) joined" "$clog2" || true)
    [[ -n $join_line ]] || continue  # reported below
    gap=$(awk -v a="$serving_s" -v b="$(glog_s "$join_line")" \
      'BEGIN { d = b - a; if (d < -43200) d += 86400; printf "%.2f", d }')
    e2e_log "worker $r joined the restarted coordinator $gap s after it served"
    if ! awk -v d="$gap" -v l="$lease_s" 'BEGIN { exit !(d <= l) }'; then
      e2e_fail "worker $r joined the restarted coordinator only $gap s after it served (lease ${LEASE_TTL}); meanwhile the job went on without it (client reconnect/retry backoff?)"
    fi
  done
else
  e2e_fail "the restarted coordinator never logged 'coordinator listening on'"
fi

noticed=0
for ((r = 0; r < WORKERS; r++)); do
  if grep -Eq "^rank=$r (sync .* rejoined=1$|sync skipped )" "$(log "$r")"; then
    noticed=1
  fi
  grep -Eq "member rank$r \([0-9a-f]+, weight [0-9.]+\) joined" "$clog2" ||
    e2e_fail "worker $r did not join the restarted coordinator"
  # Rounds never go back, but once to the restored round from one the
  # first coordinator closed after its last checkpoint (lost to the
  # SIGKILL, see above: the member adopts the restored state).
  prev=0
  went_back=0
  while read -r round; do
    if ((round < prev)); then
      if ((!went_back)) && [[ -n $restored ]] && ((round == restored &&
        prev > restored && prev <= last_closed_1)); then
        went_back=1
        e2e_log "worker $r went back from round $prev to the restored round $round (round $prev closed after the last checkpoint)"
      else
        e2e_fail "worker $r went back from round $prev to round $round"
        break
      fi
    fi
    prev=$round
  done < <(rounds "$r")
  e2e_check_survivor "$r" "$(log "$r")" "$dumps" "$MAX_ROUNDS"
  e2e_check_loss_fell "$r" "$(log "$r")" 0.8
  e2e_last_line "$(log "$r")" "^rank=$r final "
done
((noticed)) ||
  e2e_fail "no worker printed rejoined=1 or a skipped sync: none noticed the restart"

e2e_check
e2e_pass "$WORKERS workers rode out a coordinator SIGKILL after round $last_closed_1 and its restart (resumed at round $first_closed_2); all ended at round $E2E_FINAL_ROUND with identical parameters; in $(e2e_elapsed) s"
