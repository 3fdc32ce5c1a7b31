# shellcheck shell=bash
# Shared helpers of the end-to-end tests (sourced, not run).
#
#   source "$(dirname "$0")/lib.sh"
#   e2e_init elastic              # temp dir $E2E_TMP, traps, log prefix
#   e2e_start_coordinator coordinator "$COORDINATOR" --lease_ttl=2s
#   e2e_start worker0 "$WORKER" --coordinator="127.0.0.1:$E2E_PORT" ...
#   e2e_wait_count "$E2E_TMP/worker0.log" '^rank=0 sync ' 3 60 "$pid"
#   ...; ((${#E2E_FAILURES[@]} == 0)) || e2e_finish_failed; e2e_pass "..."
#
# Nothing here sleeps to synchronise: every wait polls a condition (a line in
# a log, a process gone) every 0.1 s up to a deadline. Every process started
# with e2e_start is stopped at exit (TERM, then KILL), and every command given
# to e2e_at_exit runs then, whether the test passed, failed or was
# interrupted. E2E_KEEP_TMP=1 keeps the temp dir.

# Globals, read by the tests that source this file.
# shellcheck disable=SC2034
E2E_NAME=e2e
E2E_TMP=""
E2E_PIDS=()
E2E_FAILURES=()
E2E_AT_EXIT=()
E2E_START_US=0
E2E_PORT=""
E2E_PID=""

# Microseconds since the epoch.
e2e_now_us() { echo "${EPOCHREALTIME/./}"; }

# Seconds since e2e_init, with one decimal.
e2e_elapsed() {
  local us=$(($(e2e_now_us) - E2E_START_US))
  printf '%d.%d' $((us / 1000000)) $((us / 100000 % 10))
}

e2e_log() { echo "[$E2E_NAME +$(e2e_elapsed)s] $*"; }

# e2e_init NAME: makes the temp dir and installs the exit/interrupt traps.
e2e_init() {
  E2E_NAME=$1
  E2E_START_US=$(e2e_now_us)
  E2E_TMP=$(mktemp -d -t "localsgd-$1.XXXXXX")
  trap e2e_cleanup EXIT
  trap 'echo "[$E2E_NAME] interrupted" >&2; exit 130' INT TERM
}

# e2e_at_exit CMD...: runs CMD (one string, eval'ed) at exit, after the
# processes are stopped; in reverse order of registration.
e2e_at_exit() { E2E_AT_EXIT+=("$*"); }

e2e_cleanup() {
  local pid i
  # No "Terminated"/"Killed" notices for what is stopped here.
  disown -a 2>/dev/null || true
  for pid in "${E2E_PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${E2E_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  for ((i = ${#E2E_AT_EXIT[@]} - 1; i >= 0; i--)); do
    eval "${E2E_AT_EXIT[i]}" || true
  done
  if [[ -n $E2E_TMP ]]; then
    if [[ ${E2E_KEEP_TMP:-0} == 1 ]]; then
      echo "[$E2E_NAME] kept $E2E_TMP" >&2
    else
      rm -rf "$E2E_TMP"
    fi
  fi
}

# e2e_fail MESSAGE: records a failure (the test goes on).
e2e_fail() {
  E2E_FAILURES+=("$*")
  echo "[$E2E_NAME +$(e2e_elapsed)s] FAIL: $*" >&2
}

# Prints every log of the temp dir and the failures, and exits 1.
e2e_finish_failed() {
  local f
  for f in "$E2E_TMP"/*.log; do
    [[ -e $f ]] || continue
    echo "----- ${f##*/} -----" >&2
    cat "$f" >&2
  done
  echo "===== $E2E_NAME FAILED after $(e2e_elapsed) s:" >&2
  for f in "${E2E_FAILURES[@]}"; do echo "  - $f" >&2; done
  exit 1
}

# e2e_die MESSAGE: a failure that ends the test at once.
e2e_die() {
  e2e_fail "$*"
  e2e_finish_failed
}

# Exits 1 with the logs if any failure was recorded.
e2e_check() { ((${#E2E_FAILURES[@]} == 0)) || e2e_finish_failed; }

e2e_pass() { e2e_log "PASS: $*"; }

# e2e_require_executable FILE...
e2e_require_executable() {
  local bin
  for bin in "$@"; do
    [[ -x $bin ]] || e2e_die "$bin is not an executable"
  done
}

# e2e_start NAME CMD...: runs CMD in the background, stdout and stderr to
# $E2E_TMP/NAME.log. Sets E2E_PID to its pid (CMD itself: bash execs it), which
# is stopped at exit.
e2e_start() {
  local name=$1
  shift
  "$@" > "$E2E_TMP/$name.log" 2>&1 &
  E2E_PID=$!
  E2E_PIDS+=("$E2E_PID")
}

# e2e_alive PID: whether the process runs (a zombie not yet reaped counts).
e2e_alive() { kill -0 "$1" 2>/dev/null; }

# e2e_count FILE REGEX: lines of FILE matching the extended REGEX.
e2e_count() {
  local n
  n=$(grep -Ec -- "$2" "$1" 2>/dev/null) || true
  echo "${n:-0}"
}

# e2e_wait_count FILE REGEX N TIMEOUT_S [PID]: waits until FILE has at least N
# lines matching REGEX. Returns 1 after TIMEOUT_S seconds, or as soon as PID
# (if given) is gone without the lines having appeared.
e2e_wait_count() {
  local file=$1 regex=$2 n=$3 timeout=$4 pid=${5:-}
  local deadline=$(($(e2e_now_us) + timeout * 1000000))
  while :; do
    (($(e2e_count "$file" "$regex") >= n)) && return 0
    if [[ -n $pid ]] && ! e2e_alive "$pid"; then
      (($(e2e_count "$file" "$regex") >= n)) && return 0
      return 1
    fi
    (($(e2e_now_us) < deadline)) || return 1
    sleep 0.1
  done
}

# e2e_wait_line FILE REGEX TIMEOUT_S [PID]: e2e_wait_count with N = 1.
e2e_wait_line() { e2e_wait_count "$1" "$2" 1 "$3" "${4:-}"; }

# e2e_wait_exit PID TIMEOUT_S: waits for the process (a child of this shell)
# to end and returns its exit status; after TIMEOUT_S seconds sends TERM, then
# KILL 5 s later, and returns 124.
e2e_wait_exit() {
  local pid=$1 timeout=$2 rc=0
  local deadline=$(($(e2e_now_us) + timeout * 1000000))
  while e2e_alive "$pid" && (($(e2e_now_us) < deadline)); do sleep 0.1; done
  if e2e_alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do e2e_alive "$pid" || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    { wait "$pid"; } 2>/dev/null || true
    return 124
  fi
  # (braces: no "Killed" notice from bash for a process killed on purpose)
  { wait "$pid"; } 2>/dev/null || rc=$?
  return "$rc"
}

# e2e_kill9 PID: SIGKILL and reap (bounded: a killed process ends at once).
e2e_kill9() {
  kill -KILL "$1" 2>/dev/null || true
  e2e_wait_exit "$1" 10 || true
}

# e2e_wait_port_file FILE PID TIMEOUT_S: waits until FILE holds a port
# number; sets E2E_PORT. Fails the test if PID exits first or on timeout.
e2e_wait_port_file() {
  local file=$1 pid=$2 timeout=$3 port
  local deadline=$(($(e2e_now_us) + timeout * 1000000))
  E2E_PORT=""
  while (($(e2e_now_us) < deadline)); do
    if [[ -s $file ]]; then
      port=$(tr -d '[:space:]' < "$file")
      if [[ $port =~ ^[0-9]+$ ]]; then
        # shellcheck disable=SC2034  # read by the tests
        E2E_PORT=$port
        return 0
      fi
    fi
    e2e_alive "$pid" || e2e_die "the coordinator (pid $pid) exited before writing $file"
    sleep 0.1
  done
  e2e_die "the coordinator did not write $file within $timeout s"
}

# e2e_start_coordinator NAME CMD...: starts the coordinator (CMD: its binary
# and flags, possibly behind a wrapper such as `ip netns exec NS`) with
# --port_file=$E2E_TMP/NAME.port appended (and --listen=127.0.0.1:0 unless CMD
# has a --listen) and waits until it serves. Sets E2E_PID and E2E_PORT.
e2e_start_coordinator() {
  local name=$1 binary=$2
  shift 2
  local listen=(--listen=127.0.0.1:0) arg
  for arg in "$@"; do [[ $arg == --listen=* ]] && listen=(); done
  rm -f "$E2E_TMP/$name.port"
  e2e_start "$name" "$binary" "$@" "${listen[@]}" --port_file="$E2E_TMP/$name.port"
  e2e_wait_port_file "$E2E_TMP/$name.port" "$E2E_PID" 30
}

# e2e_stop_coordinator PID: SIGTERM; fails the test unless it exits 0 within
# 30 s.
e2e_stop_coordinator() {
  local pid=$1 rc=0
  kill -TERM "$pid" 2>/dev/null || true
  e2e_wait_exit "$pid" 30 || rc=$?
  if ((rc == 124)); then
    e2e_fail "the coordinator did not exit within 30 s of SIGTERM"
  elif ((rc != 0)); then
    e2e_fail "the coordinator exited with status $rc after SIGTERM"
  fi
}

# e2e_value KEY LINE: the value of KEY=... in LINE.
e2e_value() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<< " $2"; }

# e2e_last_line FILE REGEX: the last line of FILE matching REGEX.
e2e_last_line() { grep -E -- "$2" "$1" 2>/dev/null | tail -n 1 || true; }

# e2e_last_round DIR RANK: the highest R of DIR/r<RANK>_round<R>.bin; empty if
# none.
e2e_last_round() {
  local f best="" r
  for f in "$1"/r"$2"_round*.bin; do
    [[ -e $f ]] || continue
    r=${f##*_round}
    r=${r%.bin}
    if [[ -z $best ]] || ((r > best)); then best=$r; fi
  done
  echo "$best"
}

# e2e_check_loss_fell RANK LOGFILE FACTOR: fails unless the worker's final line
# has last_loss < FACTOR * first_loss.
e2e_check_loss_fell() {
  local rank=$1 log=$2 factor=$3 final first last
  final=$(e2e_last_line "$log" "^rank=$rank final ")
  if [[ -z $final ]]; then
    e2e_fail "worker $rank printed no final line"
    return
  fi
  first=$(e2e_value first_loss "$final")
  last=$(e2e_value last_loss "$final")
  if ! awk -v f="$first" -v l="$last" -v x="$factor" \
      'BEGIN { exit !(f > 0 && l < x * f) }'; then
    e2e_fail "worker $rank: training loss did not fall: first_loss=$first last_loss=$last (want last < $factor first)"
  fi
}

# e2e_check_survivor RANK LOG DUMPS MIN_ROUND: checks a worker that ran to the
# end: its last sync (in LOG) reached round >= MIN_ROUND, its last dump in
# DUMPS is of that round and equals its --dump_params ($E2E_TMP/final<RANK>.bin),
# it ended in the same round as the survivors checked before it
# (E2E_FINAL_ROUND, set by the first), and its final parameters equal worker
# 0's ($E2E_TMP/final0.bin) byte for byte.
E2E_FINAL_ROUND=""
e2e_check_survivor() {
  local r=$1 log=$2 dumps=$3 min_round=$4 fr dr
  fr=$(sed -n "s/^rank=$r sync round=\([0-9]*\) .*/\1/p" "$log" | tail -n 1)
  fr=${fr:-0}
  ((fr >= min_round)) || e2e_fail "worker $r ended at round $fr, want >= $min_round"
  dr=$(e2e_last_round "$dumps" "$r")
  [[ $dr == "$fr" ]] ||
    e2e_fail "worker $r: last dump r${r}_round${dr:-none}.bin, last sync line round $fr"
  if [[ -z $E2E_FINAL_ROUND ]]; then
    E2E_FINAL_ROUND=$fr
  elif [[ $fr != "$E2E_FINAL_ROUND" ]]; then
    e2e_fail "workers ended in different rounds: round $E2E_FINAL_ROUND, worker $r at $fr"
  fi
  if [[ ! -s $E2E_TMP/final$r.bin ]]; then
    e2e_fail "worker $r wrote no --dump_params file"
    return
  fi
  if ((r > 0)) && ! cmp -s "$E2E_TMP/final0.bin" "$E2E_TMP/final$r.bin"; then
    e2e_fail "worker $r's final parameters differ from worker 0's: $(cmp "$E2E_TMP/final0.bin" "$E2E_TMP/final$r.bin" 2>&1 | head -n 1)"
  fi
  if [[ -f $dumps/r${r}_round$fr.bin ]] &&
      ! cmp -s "$dumps/r${r}_round$fr.bin" "$E2E_TMP/final$r.bin"; then
    e2e_fail "worker $r's --dump_params differs from its round $fr dump"
  fi
}
