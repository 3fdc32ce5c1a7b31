# shellcheck shell=bash
# Shared by scripts/run-demo.sh and scripts/run-nodes.sh: start a coordinator
# and worker processes on this machine, keep their output in log files, show
# the run (scripts/demo_view.py), stop them all on exit. Source it after
# setting LAUNCH_TAG (the output prefix), COORDINATOR and WORKER.
#
# Environment: LOG_DIR (where the logs and the plot go; default a new
#   /tmp/localsgd-$LAUNCH_TAG.XXXXXX, kept after the run); VIEW: "auto"
#   (default: the compact view, redrawn in place on a terminal, plain lines
#   otherwise) or "logs" (every process's lines, prefixed, as they come).

log() { echo "[$LAUNCH_TAG] $*"; }
die() { echo "[$LAUNCH_TAG] error: $*" >&2; exit 1; }

for bin in "$COORDINATOR" "$WORKER"; do
  [[ -x $bin ]] || die "$bin not found; build first (scripts/build.sh, or BUILD_DIR=<dir>)"
done

VIEW=${VIEW:-auto}
[[ $VIEW == auto || $VIEW == logs ]] || die "VIEW=$VIEW: expected auto or logs"
if [[ -n ${LOG_DIR:-} ]]; then
  mkdir -p "$LOG_DIR"
  tmp=$(cd "$LOG_DIR" && pwd)
else
  tmp=$(mktemp -d -t "localsgd-$LAUNCH_TAG.XXXXXX")
fi
# The view needs Debian's python3 (scripts/install-deps.sh).
VIEW_PYTHON=/usr/bin/python3
if [[ $VIEW == auto && ! -x $VIEW_PYTHON ]]; then VIEW=logs; fi
coordinator_pid=""
worker_pids=()

# Stops whatever is still running (each child leads its own process group,
# with the sed/tee that prefixes its output). The logs stay.
cleanup() {
  local pid
  for pid in "${worker_pids[@]}" $coordinator_pid; do
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  for pid in "${worker_pids[@]}" $coordinator_pid; do
    for _ in $(seq 50); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  rm -f "$tmp/port" "$tmp/http_port"
}
trap cleanup EXIT
trap 'echo "[$LAUNCH_TAG] interrupted" >&2; exit 130' INT TERM

# start TAG LOGFILE CMD...: runs CMD in a new session (its pid is the process
# group id), its stdout+stderr written to LOGFILE (and with VIEW=logs also
# printed as "[TAG] line"). Sets STARTED_PID.
start() {
  local tag=$1 logfile=$2
  shift 2
  if [[ $VIEW == logs ]]; then
    # shellcheck disable=SC2016  # expanded by the inner bash
    setsid bash -c 'tag=$1 logfile=$2; shift 2
      exec "$@" > >(tee "$logfile" | sed -u "s/^/[$tag] /") 2>&1' \
      _ "$tag" "$logfile" "$@" &
  else
    # shellcheck disable=SC2016
    setsid bash -c 'logfile=$1; shift; exec "$@" > "$logfile" 2>&1' \
      _ "$logfile" "$@" < /dev/null &
  fi
  STARTED_PID=$!
}

# Waits until process group $1 (a finished child and its output filters) is
# gone, so that its last lines are printed; at most 2 s.
drain() {
  for _ in $(seq 20); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.1; done
}

# Reads a port file the coordinator writes once it serves: waits up to 30 s.
read_port() {
  local file=$1 value=""
  for _ in $(seq 300); do
    if [[ -s $file ]]; then
      value=$(tr -d '[:space:]' < "$file")
      [[ $value =~ ^[0-9]+$ ]] && { echo "$value"; return 0; }
    fi
    kill -0 "$coordinator_pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# Starts the coordinator on a free loopback port, with its status page on
# another (--http_listen), and waits until it listens. Sets coordinator_pid,
# port and http_port.
start_coordinator() {
  start coordinator "$tmp/coordinator.log" \
    "$COORDINATOR" --listen=127.0.0.1:0 --port_file="$tmp/port" \
    --http_listen=127.0.0.1:0 --http_port_file="$tmp/http_port"
  coordinator_pid=$STARTED_PID
  port=$(read_port "$tmp/port") || die "the coordinator did not start (see $tmp/coordinator.log)"
  http_port=$(read_port "$tmp/http_port") || die "the coordinator did not start its status page"
  log "logs: $tmp/ (coordinator.log, worker<R>.log); status page: http://127.0.0.1:$http_port/"
}

# show_run JOB TITLE [LABELS]: the compact view of the run until every worker
# is gone (VIEW=auto), then its summary and plot ($tmp/training.png).
show_run() {
  [[ $VIEW == auto ]] || return 0
  local pids
  pids=$(IFS=,; echo "${worker_pids[*]}")
  "$VIEW_PYTHON" scripts/demo_view.py --log_dir="$tmp" \
    --workers="${#worker_pids[@]}" --pids="$pids" \
    --status="http://127.0.0.1:$http_port/api/v1/status?job=$1&rounds=100" \
    --title="$2" --labels="${3:-}" --plot="$tmp/training.png" ||
    log "warning: the view failed (the run goes on; logs in $tmp/)"
}

# Waits for every worker in worker_pids; sets failed=1 (read by the
# sourcing script) if any failed.
# shellcheck disable=SC2034
wait_workers() {
  local r rc
  failed=0
  for ((r = 0; r < ${#worker_pids[@]}; r++)); do
    rc=0
    wait "${worker_pids[r]}" || rc=$?
    drain "${worker_pids[r]}"
    if ((rc != 0)); then
      log "worker $r failed (exit status $rc)"
      failed=1
    fi
  done
}

# SIGTERM to the coordinator; waits up to 30 s for it to drain and exit.
stop_coordinator() {
  local rc=0
  kill -TERM "$coordinator_pid" 2>/dev/null || true
  for _ in $(seq 300); do kill -0 "$coordinator_pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$coordinator_pid" 2>/dev/null; then
    log "warning: the coordinator did not stop within 30 s of SIGTERM; killing it"
  else
    wait "$coordinator_pid" || rc=$?
    drain "$coordinator_pid"
    ((rc == 0)) || log "warning: the coordinator exited with status $rc"
  fi
}

# Prints every worker's final line (VIEW=logs; the view has a summary).
print_finals() {
  local r
  [[ $VIEW == logs ]] || return 0
  echo
  log "summary:"
  for ((r = 0; r < ${#worker_pids[@]}; r++)); do
    grep -h " final " "$tmp/worker$r.log" | sed "s/^/[$LAUNCH_TAG]   /" || true
  done
}
