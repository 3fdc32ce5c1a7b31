#!/usr/bin/env bash
# Regional coordinators against one flat coordinator, over a slow link
# between regions.
#
# Two regions of WORKERS_PER_REGION workers each. Every host (a worker, a
# regional coordinator) is a network namespace wired to its region's switch
# by a link of INTRA_RATE each way; each region's switch reaches the core
# switch by one link of INTER_RATE each way; the upstream (global)
# coordinator's host is on the core switch at INTRA_RATE. All `tc tbf`
# (this kernel has no netem: no added latency), on a private
# 10.215.<random>.0/24 that exists only inside these namespaces.
#
#   flat:     one coordinator on the core host; every worker syncs with it
#             across its region's slow uplink (bench/sync_bench, world =
#             2 x WORKERS_PER_REGION);
#   regional: the same coordinator as the upstream, a regional coordinator
#             per region (--upstream), each region's workers syncing with
#             their own (one sync_bench per region, run at once). A region
#             sends one contribution across its uplink a round.
#
# Every worker of a region has the same rank as its twin in the other
# region, so the flat mean over both regions is each region's own mean:
# sync_bench checks the elements it samples against that mean and every
# worker's whole state by CRC32C after every round, in both setups. Prints
# a markdown table: round median per setup, the link lower bound, and
# regional / flat.
#
# Usage: bench/netns_regional.sh     (as root; exit 77 when it cannot run)
# Environment (defaults in brackets): BUILD_DIR [<repo>/build-bench],
#   BUILD_TYPE [Release], WORKERS_PER_REGION [4], MILLIONS [25], ROUNDS [3],
#   INTRA_RATE [1gbit], INTER_RATE [100mbit], BURST [512kb], WIRE [float32]
#   (the flat job's and the upstream job's wire; a region's own rounds are
#   float32 MEAN),
#   UPSTREAM_FLAGS [] (e.g. --averaging=outer_nesterov), RUN_TIMEOUT [1800],
#   OUT_DIR [<BUILD_DIR>/netns-regional/<date>].
#
# Lower bounds per round: flat, a region's uplink carries its workers'
# payloads (W x bytes each way); regional, a region's coordinator link
# carries its workers' float32 payloads up, then its uplink one
# contribution up while the result comes down, which the region's
# coordinator passes on to its workers as it arrives (pipelined down, not
# up), see docs/design.md "Regional coordinators".
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
BUILD_DIR=${BUILD_DIR:-$REPO/build-bench}
BUILD_TYPE=${BUILD_TYPE:-Release}
WPR=${WORKERS_PER_REGION:-4}
MILLIONS=${MILLIONS:-25}
ROUNDS=${ROUNDS:-3}
INTRA_RATE=${INTRA_RATE:-1gbit}
INTER_RATE=${INTER_RATE:-100mbit}
BURST=${BURST:-512kb}
WIRE=${WIRE:-float32}
UPSTREAM_FLAGS=${UPSTREAM_FLAGS:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/netns-regional/$(date +%Y%m%d-%H%M%S)}

log() { echo "[netns_regional] $*" >&2; }
die() { echo "[netns_regional] error: $*" >&2; exit 1; }
skip() { echo "[netns_regional] SKIP: $*" >&2; exit 77; }

[[ $(id -u) == 0 ]] || skip "needs root (network namespaces, veth, bridge, tc)"
command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
command -v tc >/dev/null || skip "the tc command (iproute2) is not installed"

if [[ ! -f $BUILD_DIR/build.ninja ]]; then
  log "configuring $BUILD_DIR ($BUILD_TYPE, no LibTorch, no tests)"
  cmake -S "$REPO" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DLOCALSGD_BUILD_TORCH=OFF -DLOCALSGD_BUILD_TESTS=OFF \
    -DLOCALSGD_BUILD_BENCH=ON >&2 || die "cmake failed"
fi
ninja -C "$BUILD_DIR" localsgd-coordinator sync_bench >&2 || die "build failed"
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
SYNC_BENCH=$BUILD_DIR/bench/sync_bench
mkdir -p "$OUT_DIR"
log "results and logs in $OUT_DIR"

# --- the network ---------------------------------------------------------------
tag="lsgdr$$"
subnet="10.215.$((RANDOM % 254 + 1))"
ns_core="$tag-core"
ns_up="$tag-up"
ns_sw=("$tag-swa" "$tag-swb")
ns_rc=("$tag-rca" "$tag-rcb")
ns_w=()     # flat ranks 0 .. 2 WPR - 1: region a, then region b
ns_alias=() # region b's workers again as ranks 0 .. WPR - 1
for ((r = 0; r < 2 * WPR; r++)); do ns_w+=("$tag-w$r"); done
for ((r = 0; r < WPR; r++)); do ns_alias+=("$tag-b$r"); done
up_ip="$subnet.1"
rc_ip() { echo "$subnet.$((10 + $1))"; }
worker_ip() { echo "$subnet.$((100 + $1))"; }

pids=()
remove_namespaces() {
  local ns pid
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for ns in "${ns_alias[@]}"; do
    umount "/run/netns/$ns" 2>/dev/null || true
    rm -f "/run/netns/$ns"
  done
  for ns in "${ns_w[@]}" "${ns_rc[@]}" "$ns_up" "${ns_sw[@]}" "$ns_core"; do
    ip netns list 2>/dev/null | grep -qw -- "$ns" || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    timeout 10 ip netns del "$ns" 2>/dev/null || true
  done
}
trap remove_namespaces EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

setup() {
  local out
  if ! out=$(timeout 10 "$@" 2>&1); then
    skip "cannot build the network: '$*' failed: $out"
  fi
}
switch() {  # NS: a namespace with a bridge
  setup ip netns add "$1"
  setup ip -n "$1" link add br0 type bridge
  setup ip -n "$1" link set br0 up
}
limit() {  # NS DEV RATE
  setup ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$3" burst "$BURST" latency 100ms
}
# host NS SWITCH PORT IP RATE: a host on a switch, its link limited both ways.
host() {
  local ns=$1 sw=$2 port=$3 addr=$4 rate=$5
  setup ip netns add "$ns"
  setup ip -n "$sw" link add "$port" type veth peer name eth0 netns "$ns"
  setup ip -n "$sw" link set "$port" master br0
  setup ip -n "$sw" link set "$port" up
  setup ip -n "$ns" addr add "$addr/24" dev eth0
  setup ip -n "$ns" link set eth0 up
  setup ip -n "$ns" link set lo up
  limit "$ns" eth0 "$rate"
  limit "$sw" "$port" "$rate"
}
switch "$ns_core"
host "$ns_up" "$ns_core" p-up "$up_ip" "$INTRA_RATE"
for g in 0 1; do
  switch "${ns_sw[g]}"
  # The region's uplink: a veth between its switch and the core's.
  setup ip -n "${ns_sw[g]}" link add uplink type veth peer name "r$g" netns "$ns_core"
  for end in "${ns_sw[g]} uplink" "$ns_core r$g"; do
    read -r ns dev <<<"$end"
    setup ip -n "$ns" link set "$dev" master br0
    setup ip -n "$ns" link set "$dev" up
    limit "$ns" "$dev" "$INTER_RATE"
  done
  host "${ns_rc[g]}" "${ns_sw[g]}" p-rc "$(rc_ip "$g")" "$INTRA_RATE"
  for ((k = 0; k < WPR; k++)); do
    r=$((g * WPR + k))
    host "${ns_w[r]}" "${ns_sw[g]}" "p-w$k" "$(worker_ip "$r")" "$INTRA_RATE"
  done
done
for ((k = 0; k < WPR; k++)); do
  touch "/run/netns/${ns_alias[k]}"
  mount --bind "/run/netns/${ns_w[WPR + k]}" "/run/netns/${ns_alias[k]}" ||
    skip "cannot name region b's workers for sync_bench (mount --bind)"
done
log "network: 2 regions of $WPR workers and a regional coordinator at $INTRA_RATE, uplinks $INTER_RATE, the upstream at $INTRA_RATE"

# --- runs ----------------------------------------------------------------------
# start NAME NS FLAGS...: a coordinator; echoes nothing, sets port_<NAME>.
start() {
  local name=$1 ns=$2
  shift 2
  rm -f "$OUT_DIR/$name.port"
  ip netns exec "$ns" "$COORDINATOR" --port_file="$OUT_DIR/$name.port" \
    --shutdown_grace=2s --metrics_listen= "$@" >"$OUT_DIR/$name.log" 2>&1 &
  pids+=($!)
  local k
  for ((k = 0; k < 300; ++k)); do
    [[ -s $OUT_DIR/$name.port ]] && return
    kill -0 "${pids[-1]}" 2>/dev/null || die "$name exited at start; see $OUT_DIR/$name.log"
    sleep 0.1
  done
  die "$name wrote no port in 30 s"
}
stop_all() {
  local pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
bench() {  # NAME COORDINATOR NETNS_PREFIX WORLD WIRE
  timeout --kill-after=10 $((RUN_TIMEOUT + 30)) "$SYNC_BENCH" \
    --coordinator="$2" --worker_netns="$3" --world="$4" \
    --millions="$MILLIONS" --rounds="$ROUNDS" --wire_dtype="$5" \
    --timeout="${RUN_TIMEOUT}s" >"$OUT_DIR/$1.log" 2>&1
}
field() { sed -n "s/.*[[:space:]]$2=\([^[:space:]]*\).*/\1/p" <<<" $1"; }
result() {  # LOG
  grep '^RESULT ' "$OUT_DIR/$1.log" || { tail -n 5 "$OUT_DIR/$1.log" >&2; die "$1 failed; see $OUT_DIR/$1.log"; }
}

log "flat: $((2 * WPR)) workers to one coordinator across the uplinks, ${MILLIONS}M, wire $WIRE"
# shellcheck disable=SC2086
start flat "$ns_up" --listen="$up_ip:0" $UPSTREAM_FLAGS
bench flat "$up_ip:$(<"$OUT_DIR/flat.port")" "$tag-w" $((2 * WPR)) "$WIRE" || true
stop_all
flat=$(result flat)
grep '^sync_bench: ' "$OUT_DIR/flat.log" | sed 's/^/  /' >&2 || true

log "regional: a coordinator per region (--upstream), one sync_bench per region"
# shellcheck disable=SC2086
start upstream "$ns_up" --listen="$up_ip:0" --wire_dtype="$WIRE" $UPSTREAM_FLAGS
upstream="$up_ip:$(<"$OUT_DIR/upstream.port")"
for g in 0 1; do
  start "region$g" "${ns_rc[g]}" --listen="$(rc_ip "$g"):0" --upstream="$upstream" \
    --upstream_member="region-$g" --upstream_rendezvous=2
done
bench region0 "$(rc_ip 0):$(<"$OUT_DIR/region0.port")" "$tag-w" "$WPR" float32 &
b0=$!
bench region1 "$(rc_ip 1):$(<"$OUT_DIR/region1.port")" "$tag-b" "$WPR" float32 &
b1=$!
wait "$b0" || true
wait "$b1" || true
stop_all
r0=$(result region0)
r1=$(result region1)
for name in region0 region1; do
  grep '^sync_bench: ' "$OUT_DIR/$name.log" | sed "s/^/  $name /" >&2 || true
done

/usr/bin/python3 - "$flat" "$r0" "$r1" "$INTRA_RATE" "$INTER_RATE" "$WPR" "$WIRE" "$MILLIONS" <<'EOF' | tee "$OUT_DIR/results.md"
import re, sys
flat, r0, r1, intra, inter, wpr, wire, millions = sys.argv[1:9]
wpr = int(wpr)
def kv(line):
    return dict(t.split("=", 1) for t in line.split() if "=" in t)
def bps(rate):
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8
f, a, b = kv(flat), kv(r0), kv(r1)
fm = float(f["median_s"])
rm = max(float(a["median_s"]), float(b["median_s"]))
payload = int(f["bytes_sent"])  # in the wire dtype, per worker per round
f32 = 4 * float(millions) * 1e6  # a region's own rounds: float32
flat_lb = wpr * payload / bps(inter)
# In turn: the region's uploads, then one contribution up while its result
# comes down (the other direction, at once) and goes on to the region's
# workers chunk by chunk (their downloads overlap it).
reg_lb = wpr * f32 / bps(intra) + max(payload / bps(inter), wpr * f32 / bps(intra))
print("| setup | round median s | min s | link lower bound s | median/bound | vs flat |")
print("|---|---:|---:|---:|---:|---:|")
print(f"| flat: {2 * wpr} workers, one coordinator | {fm:.3f} | {float(f['min_s']):.3f} | {flat_lb:.3f} | {fm / flat_lb:.2f} | 1.00 |")
print(f"| regional: 2 x ({wpr} workers + a coordinator), upstream wire {wire} | {rm:.3f} | "
      f"{min(float(a['min_s']), float(b['min_s'])):.3f} | {reg_lb:.3f} | {rm / reg_lb:.2f} | {rm / fm:.2f} |")
print()
print(f"Regions of {wpr} workers at {intra}, uplinks {inter}; a worker's payload {payload / 1e6:.1f} MB "
      f"each way per round in {wire} (float32 inside a region). The regional median is the slower region's.")
EOF
