#!/usr/bin/env bash
# Failover on one machine: an etcd, a primary and a standby coordinator of
# one shard (--ha_etcd), each restarted by a supervisor loop when it ends
# (as Kubernetes would restart its pod), and Local SGD workers on
# Fashion-MNIST that know both addresses ("127.0.0.1:P1|127.0.0.1:P2").
# Every KILL_EVERY seconds the primary is SIGKILLed: the standby takes over
# within the lease (--ha_lease_ttl, 2 s), the killed one comes back as the
# standby, and the workers go on. docs/design.md, "Standby coordinators".
#
# Usage: scripts/ha-local.sh [extra worker flags...]
# Environment: BUILD_DIR (build), WORKERS (3), EPOCHS (1), K (16),
#   KILL_EVERY (8; 0: never, kill it yourself: the primary's pid is in
#   $LOG_DIR/primary.pid), LOG_DIR (default a new /tmp/localsgd-ha.XXXXXX).
# Exit status: 0 if every worker succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
WORKERS=${WORKERS:-3}
EPOCHS=${EPOCHS:-1}
K=${K:-16}
KILL_EVERY=${KILL_EVERY:-8}
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
CTL=$BUILD_DIR/tools/localsgdctl
WORKER=$BUILD_DIR/examples/localsgd-fashion-mnist
ETCD=/usr/bin/etcd

log() { echo "[ha-local] $*"; }
die() { echo "[ha-local] error: $*" >&2; exit 1; }
for bin in "$COORDINATOR" "$CTL" "$WORKER" "$ETCD"; do
  [[ -x $bin ]] || die "$bin not found (scripts/build.sh; scripts/install-deps.sh installs etcd)"
done
if [[ -n ${LOG_DIR:-} ]]; then mkdir -p "$LOG_DIR"; tmp=$(cd "$LOG_DIR" && pwd)
else tmp=$(mktemp -d -t localsgd-ha.XXXXXX); fi

free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pids=()
cleanup() {
  touch "$tmp/stopping"
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

etcd_port=$(free_port)
etcd_peer=$(free_port)
setsid "$ETCD" --name ha-local --data-dir "$tmp/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" \
  --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-cluster "ha-local=http://127.0.0.1:$etcd_peer" \
  > "$tmp/etcd.log" 2>&1 < /dev/null &
pids+=($!)

ports=("$(free_port)" "$(free_port)")
targets="127.0.0.1:${ports[0]}|127.0.0.1:${ports[1]}"
for i in 0 1; do
  # The supervisor: runs the coordinator again whenever it ends (killed, or
  # exited 3 after losing its lease), as a standby.
  # shellcheck disable=SC2016
  setsid bash -c 'i=$1 port=$2 tmp=$3; shift 3
    while [[ ! -e $tmp/stopping ]]; do
      "$@" --listen=127.0.0.1:$port --ha_advertise=127.0.0.1:$port \
        >> "$tmp/coordinator$i.log" 2>&1 &
      echo $! > "$tmp/coordinator$i.pid"
      wait $! && rc=0 || rc=$?
      echo "[ha-local] coordinator $i (127.0.0.1:$port) ended ($rc); restarting it" >> "$tmp/coordinator$i.log"
    done' _ "$i" "${ports[$i]}" "$tmp" \
    "$COORDINATOR" --ha_etcd="127.0.0.1:$etcd_port" --ha_group=ha-local \
    < /dev/null &
  pids+=($!)
done

# primary: the index of the coordinator whose readiness is SERVING.
primary() {
  for i in 0 1; do
    if "$CTL" --target="127.0.0.1:${ports[$i]}" health > /dev/null 2>&1; then
      echo "$i"; return 0
    fi
  done
  return 1
}
for _ in $(seq 300); do primary > /dev/null && break; sleep 0.1; done
p=$(primary) || die "no coordinator became the primary (see $tmp/coordinator*.log, $tmp/etcd.log)"
log "etcd at 127.0.0.1:$etcd_port; coordinators at $targets; primary: coordinator $p"
log "logs: $tmp/"

worker_pids=()
for ((r = 0; r < WORKERS; r++)); do
  setsid "$WORKER" --coordinator="$targets" --job=ha-local --world="$WORKERS" \
    --rank="$r" --k="$K" --epochs="$EPOCHS" --log_every=50 "$@" \
    > "$tmp/worker$r.log" 2>&1 < /dev/null &
  worker_pids+=($!)
  pids+=($!)
done

running() {
  for pid in "${worker_pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}
kills=0
next_kill=$((SECONDS + KILL_EVERY))
while running; do
  if ((KILL_EVERY > 0 && SECONDS >= next_kill)) && p=$(primary); then
    kill -KILL "$(cat "$tmp/coordinator$p.pid")" 2>/dev/null || true
    kills=$((kills + 1))
    start=$SECONDS
    # Either may win: the standby, or the killed one back first (its
    # supervisor restarts it at once, and its old lease has to run out for
    # both).
    until q=$(primary); do
      sleep 0.1
      ((SECONDS - start < 30)) || die "no coordinator took over in 30 s"
    done
    log "killed the primary (coordinator $p); coordinator $q serves now, after $((SECONDS - start)) s (kill $kills)"
    next_kill=$((SECONDS + KILL_EVERY))
  fi
  sleep 0.2
done

failed=0
for ((r = 0; r < WORKERS; r++)); do
  if wait "${worker_pids[$r]}"; then
    log "worker $r: $(grep -E 'accuracy|rounds' "$tmp/worker$r.log" | tail -1)"
  else
    log "worker $r failed (see $tmp/worker$r.log)"
    failed=1
  fi
done
log "$kills failovers; logs in $tmp/"
exit $failed
