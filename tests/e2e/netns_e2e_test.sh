#!/usr/bin/env bash
# End-to-end over a real (virtual) network, with a link cut: one network
# namespace per host (a coordinator host and 3 worker hosts), each wired by a
# veth pair to a bridge in a "switch" namespace, addresses in a private
# 10.213.<random>.0/24 that exists only inside these namespaces. Nothing is
# created in, or routed from, the root namespace.
#
# The worker links are degraded: `netem delay 20ms 5ms loss 1%` both ways
# where the kernel has netem; otherwise (CONFIG_NET_SCH_NETEM off, as on some
# VMs) a 20 Mbit/s tbf both ways plus a classic-BPF filter that drops 1% of
# packets at random, and the test says so.
#
# The coordinator runs with --lease_ttl=2s; 3 workers (k=4,
# --max_rounds=100) train. After every worker has synced 3 times, worker 1's
# link is cut (its switch port set down) until the coordinator has dropped it
# for its lease and the other two have closed rounds without it, and for at
# least 5 s; then the link comes back and worker 1 must join again.
#
# Usage: netns_e2e_test.sh COORDINATOR_BINARY WORKER_BINARY
# Exit status 77 (ctest: skipped) when not root, or when this machine cannot
# create network namespaces, veth pairs or bridges.
#
# Asserts:
#  - during the cut, workers 0 and 2 went on: the coordinator logged
#    "member rank1 (...) lost its lease", a round closed members_gone with
#    rank1 dropped, and a later one complete with contributors [rank0, rank2];
#    each of them printed syncs during the cut;
#  - after the link came back, worker 1 joined again (its log shows
#    rejoined=1 after the cut; the coordinator logged its second join) and
#    synced on;
#  - every worker exits 0; all end in the same final round (>= 100) with
#    byte-identical parameters (last --dump_dir dump and --dump_params);
#  - training loss fell (worker 0: last < 0.8 first);
#  - the coordinator exits 0 on SIGTERM;
#  - the namespaces are gone afterwards (checked by the trap; it removes them
#    whether the test passes, fails or is interrupted).
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

SKIP=77
WORKERS=3
K=4
MAX_ROUNDS=100
EPOCHS=2            # 624 steps a worker, more than MAX_ROUNDS * K
CUT_WORKER=1
MIN_CUT_S=5
LEASE_TTL=2s
RUN_TIMEOUT=${E2E_RUN_TIMEOUT:-170}  # seconds, the whole job

skip() {
  echo "SKIP: netns_e2e: $*" >&2
  exit "$SKIP"
}
if [[ $(id -u) != 0 ]]; then
  skip "needs root (it creates network namespaces, veth pairs and a bridge); run as root to test over a network with a link cut"
fi
command -v ip > /dev/null || skip "the ip command (iproute2) is not installed"

e2e_init netns
e2e_require_executable "$COORDINATOR" "$WORKER"
dumps=$E2E_TMP/dumps
mkdir -p "$dumps"

# --- the network ---
tag="lsgd$$"
subnet="10.213.$((RANDOM % 254 + 1))"
ns_sw="$tag-sw"
ns_c="$tag-c"
ns_w=()
for ((r = 0; r < WORKERS; r++)); do ns_w+=("$tag-w$r"); done
coordinator_ip="$subnet.1"
worker_ip() { echo "$subnet.$((10 + $1))"; }

# Deletes the namespaces (their veths and the bridge go with them) after
# killing anything still running in them; says if one survived.
remove_namespaces() {
  local ns pid
  for ns in "$ns_c" "${ns_w[@]}" "$ns_sw"; do
    ip netns list 2>/dev/null | grep -qw -- "$ns" || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -KILL "$pid" 2>/dev/null || true
    done
    timeout 10 ip netns del "$ns" 2>/dev/null || true
    if ip netns list 2>/dev/null | grep -qw -- "$ns"; then
      echo "[netns] WARNING: could not delete network namespace $ns" >&2
    fi
  done
}
e2e_at_exit remove_namespaces

# setup CMD...: a step of building the network; if it fails, this machine
# cannot host the test: skip (the trap removes what was built).
setup() {
  local out
  if ! out=$(timeout 10 "$@" 2>&1); then
    skip "cannot build the test network: '$*' failed: $out"
  fi
}

setup ip netns add "$ns_sw"
setup ip netns add "$ns_c"
for ns in "${ns_w[@]}"; do setup ip netns add "$ns"; done
setup ip -n "$ns_sw" link add br0 type bridge
setup ip -n "$ns_sw" link set br0 up
# wire HOST_NS PORT IP: veth PORT (switch side, on br0) <-> eth0 in HOST_NS.
wire() {
  local ns=$1 port=$2 addr=$3
  setup ip -n "$ns_sw" link add "$port" type veth peer name eth0 netns "$ns"
  setup ip -n "$ns_sw" link set "$port" master br0
  setup ip -n "$ns_sw" link set "$port" up
  setup ip -n "$ns" addr add "$addr/24" dev eth0
  setup ip -n "$ns" link set eth0 up
  setup ip -n "$ns" link set lo up
}
wire "$ns_c" p-c "$coordinator_ip"
for ((r = 0; r < WORKERS; r++)); do wire "${ns_w[r]}" "p-w$r" "$(worker_ip "$r")"; done

# Degrade the worker links, both directions: netem if the kernel has it,
# else tbf (rate) + a classic BPF filter dropping 1% (ld rand; jgt 0.99*2^32:
# TC_ACT_SHOT).
shaping=""
# shape NS DEV
shape() {
  local ns=$1 dev=$2
  if [[ -z $shaping || $shaping == netem ]] &&
      ip netns exec "$ns" tc qdisc add dev "$dev" root netem delay 20ms 5ms loss 1% 2>/dev/null; then
    shaping=netem
    return
  fi
  [[ $shaping == netem ]] && e2e_die "netem worked on one link and not on $ns/$dev"
  shaping="tbf+bpf-loss"
  setup ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate 20mbit burst 32kb latency 400ms
  if ip netns exec "$ns" tc qdisc add dev "$dev" clsact 2>/dev/null &&
      ip netns exec "$ns" tc filter add dev "$dev" egress bpf da \
        bytecode "4,32 0 0 4294963256,37 0 1 4252017623,6 0 0 2,6 0 0 4294967295" 2>/dev/null; then
    :
  else
    shaping="tbf-only"
  fi
}
for ((r = 0; r < WORKERS; r++)); do
  shape "${ns_w[r]}" eth0
  shape "$ns_sw" "p-w$r"
done
case $shaping in
  netem) e2e_log "worker links: netem delay 20ms 5ms loss 1%, both ways" ;;
  tbf+bpf-loss) e2e_log "worker links: this kernel has no netem; using tbf rate 20mbit + 1% random drop (classic BPF), both ways: no added latency beyond the rate's" ;;
  *) e2e_log "worker links: this kernel has no netem and no cls_bpf drop; using tbf rate 20mbit only (no loss)" ;;
esac
e2e_log "network: switch $ns_sw (br0), coordinator $ns_c at $coordinator_ip, workers ${ns_w[*]} at $subnet.10-$((9 + WORKERS))"

run_deadline=$(($(e2e_now_us) + RUN_TIMEOUT * 1000000))
left() {
  local s=$(((run_deadline - $(e2e_now_us)) / 1000000))
  echo $((s > 0 ? s : 1))
}

# --- the job ---
e2e_start_coordinator coordinator ip netns exec "$ns_c" "$COORDINATOR" \
  --listen="$coordinator_ip:0" --lease_ttl="$LEASE_TTL"
coordinator_pid=$E2E_PID
port=$E2E_PORT
e2e_log "coordinator on $coordinator_ip:$port in $ns_c (lease $LEASE_TTL)"

declare -a pids
for ((r = 0; r < WORKERS; r++)); do
  e2e_start "worker$r" ip netns exec "${ns_w[r]}" "$WORKER" \
    --coordinator="$coordinator_ip:$port" --job=netns --world="$WORKERS" \
    --rank="$r" --k="$K" --epochs="$EPOCHS" --max_rounds="$MAX_ROUNDS" \
    --dump_dir="$dumps" --dump_params="$E2E_TMP/final$r.bin" \
    --log_every=20 --eval_every_sync=0 --eval_examples=1000
  pids[r]=$E2E_PID
done
log() { echo "$E2E_TMP/worker$1.log"; }
sync_re() { echo "^rank=$1 sync round="; }
syncs() { e2e_count "$(log "$1")" "$(sync_re "$1")"; }
# rounds RANK: the rounds of the worker's sync lines, one a line.
rounds() { sed -n "s/^rank=$1 sync round=\([0-9]*\) .*/\1/p" "$(log "$1")"; }
clog=$E2E_TMP/coordinator.log

for ((r = 0; r < WORKERS; r++)); do
  e2e_wait_count "$(log "$r")" "$(sync_re "$r")" 3 "$(left)" "${pids[r]}" ||
    e2e_die "worker $r did not sync 3 times over the network"
done

# --- the cut ---
others=()
for ((r = 0; r < WORKERS; r++)); do ((r == CUT_WORKER)) || others+=("$r"); done
cut_lines=$(wc -l < "$(log "$CUT_WORKER")")
ip -n "$ns_sw" link set "p-w$CUT_WORKER" down
cut_us=$(e2e_now_us)
e2e_log "cut worker $CUT_WORKER's link (p-w$CUT_WORKER down) at its round $(rounds "$CUT_WORKER" | tail -n 1)"
e2e_wait_line "$clog" "member rank$CUT_WORKER \([0-9a-f]+\) lost its lease" 30 "$coordinator_pid" ||
  e2e_die "the coordinator did not drop worker $CUT_WORKER within 30 s of the cut"
e2e_log "the coordinator dropped worker $CUT_WORKER for its lease"
declare -A at_loss
for r in "${others[@]}"; do at_loss[$r]=$(syncs "$r"); done
for r in "${others[@]}"; do
  e2e_wait_count "$(log "$r")" "$(sync_re "$r")" $((at_loss[$r] + 2)) 30 "${pids[r]}" ||
    e2e_die "worker $r did not sync twice after worker $CUT_WORKER was dropped (the cut blocked the job)"
done
# The cut lasts at least MIN_CUT_S: a fault's duration, not a synchronisation.
while (($(e2e_now_us) - cut_us < MIN_CUT_S * 1000000)); do sleep 0.1; done
ip -n "$ns_sw" link set "p-w$CUT_WORKER" up
cut_s=$(awk -v us=$(($(e2e_now_us) - cut_us)) 'BEGIN { printf "%.1f", us / 1e6 }')
declare -A during_cut
for r in "${others[@]}"; do during_cut[$r]=$(( $(syncs "$r") - at_loss[$r] )); done
e2e_log "restored worker $CUT_WORKER's link after $cut_s s; meanwhile workers ${others[*]} synced ${during_cut[*]} times after the lease loss (now at round $(rounds "${others[0]}" | tail -n 1))"

# --- the end ---
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
grep -Eq "round [0-9]+ closed \(members_gone\).*dropped \[([a-z0-9]+, )*rank${CUT_WORKER}[],]" "$clog" ||
  e2e_fail "no round closed without worker $CUT_WORKER (members_gone, dropped [rank$CUT_WORKER])"
others_re=$(for r in "${others[@]}"; do printf 'rank%s, ' "$r"; done)
others_re="\[${others_re%, }\]"
grep -Eq "round [0-9]+ closed \(complete\) in .*; contributors $others_re\$" "$clog" ||
  e2e_fail "no round closed complete with only workers ${others[*]} during the cut (contributors $others_re)"
joins=$(e2e_count "$clog" "member rank$CUT_WORKER \([0-9a-f]+, weight [0-9.]+\) joined")
((joins >= 2)) ||
  e2e_fail "worker $CUT_WORKER joined $joins time(s); want a second join after its lease was lost"
after_cut=$(tail -n +$((cut_lines + 1)) "$(log "$CUT_WORKER")")
grep -Eq "^rank=$CUT_WORKER sync round=.* rejoined=1$" <<< "$after_cut" ||
  e2e_fail "worker $CUT_WORKER printed no sync with rejoined=1 after the cut"
after_syncs=$(grep -Ec "^rank=$CUT_WORKER sync round=" <<< "$after_cut" || true)
((after_syncs >= 2)) ||
  e2e_fail "worker $CUT_WORKER synced $after_syncs time(s) after the cut; want it to train on with the job"

for ((r = 0; r < WORKERS; r++)); do
  e2e_check_survivor "$r" "$(log "$r")" "$dumps" "$MAX_ROUNDS"
  e2e_last_line "$(log "$r")" "^rank=$r final "
done
e2e_check_loss_fell 0 "$(log 0)" 0.8
e2e_check

remove_namespaces
left_over=$(ip netns list | grep -E "^$tag-" || true)
[[ -z $left_over ]] || e2e_fail "namespaces left after cleanup: $left_over"
e2e_check
e2e_pass "$WORKERS workers over veth+bridge ($shaping); worker $CUT_WORKER cut off for $cut_s s (lease $LEASE_TTL), rejoined; all ended at round $E2E_FINAL_ROUND with identical parameters; in $(e2e_elapsed) s"
