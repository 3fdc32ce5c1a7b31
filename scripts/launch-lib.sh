# shellcheck shell=bash
# Shared by scripts/run-demo.sh and scripts/run-nodes.sh: start a coordinator
# and worker processes on this machine, prefix and keep their output, stop
# them all on exit. Source it after setting LAUNCH_TAG (the output prefix),
# COORDINATOR and WORKER.

log() { echo "[$LAUNCH_TAG] $*"; }
die() { echo "[$LAUNCH_TAG] error: $*" >&2; exit 1; }

for bin in "$COORDINATOR" "$WORKER"; do
  [[ -x $bin ]] || die "$bin not found; build first (scripts/build.sh, or BUILD_DIR=<dir>)"
done

tmp=$(mktemp -d -t "localsgd-$LAUNCH_TAG.XXXXXX")
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
trap 'echo "[$LAUNCH_TAG] interrupted" >&2; exit 130' INT TERM

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

# Starts the coordinator on a free loopback port (metrics endpoint off, its
# default) and waits until it listens. Sets coordinator_pid and port.
start_coordinator() {
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

# Prints every worker's final line.
print_finals() {
  local r
  echo
  log "summary:"
  for ((r = 0; r < ${#worker_pids[@]}; r++)); do
    grep -h " final " "$tmp/worker$r.log" | sed "s/^/[$LAUNCH_TAG]   /" || true
  done
}
