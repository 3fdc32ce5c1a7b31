#!/usr/bin/env bash
# Scale-out with sharded coordinators over rate-limited links.
#
# Every coordinator replica and every worker gets its own network-namespace
# "host", wired by a veth pair to one bridge in a "switch" namespace, on a
# private 10.214.<random>.0/24 that exists only inside these namespaces. Every
# host link is limited both ways with `tc ... tbf rate $RATE` (this kernel has
# no netem, so no added latency). For each S in $SHARDS and each wire dtype,
# S replicas run (`--shard_index=i --shard_count=S` when S > 1) and
# bench/sync_bench runs WORLD workers, worker r inside host w<r>
# (--worker_netns), with the replicas' addresses as --coordinator (the client
# sends chunk i to replica i mod S). Then the peer on the same hosts and
# links: accelerate's LocalSGD sync on gloo, rank r on host w<r>
# (bench/peer_rank.py over ../shared/bench/peer_accelerate_localsgd.py;
# PEER=0 skips it). Prints a markdown table: round median per S and wire,
# the speed-up over S=1, the link-limited lower bound, and ours/peer.
#
# Standby coordinators (STANDBYS="0 1"): with 1, each replica is the
# primary of its shard (--ha_etcd, an etcd on a host of its own) and a
# standby follows it from a host of its own (s<i>); each configuration runs
# without and with, side by side. The table then also gives, per run, the
# bytes the primaries' hosts sent (their links' tx counters) and the bytes
# the standbys' hosts received, and the round time against the same
# configuration without a standby.
#
# Usage: bench/netns_scaleout.sh        (as root; exit 77 when it cannot run)
# Environment (defaults in brackets): BUILD_DIR [<repo>/build-bench],
#   BUILD_TYPE [Release] (for a fresh BUILD_DIR), WORLD [4], MILLIONS [25],
#   SHARDS ["1 2 4"], WIRES ["float32 bfloat16"], ROUNDS [3], RATE [1gbit],
#   BURST [512kb], CHUNK_ELEMENTS [0], COORD_FLAGS [], BENCH_FLAGS [],
#   RUN_TIMEOUT [900], OUT_DIR [<BUILD_DIR>/netns-results/<date>], PEER [1],
#   PEER_DIR [<repo>/../shared/bench], STANDBYS [0], HA_LEASE_TTL [2s].
#
# Lower bound per round: the busiest link's bytes / RATE, where a worker's
# link carries its payload out and the result in (each direction limited
# separately), and replica i's link carries WORLD x payload / S each way.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
BUILD_DIR=${BUILD_DIR:-$REPO/build-bench}
BUILD_TYPE=${BUILD_TYPE:-Release}
WORLD=${WORLD:-4}
MILLIONS=${MILLIONS:-25}
SHARDS=${SHARDS:-1 2 4}
WIRES=${WIRES:-float32 bfloat16}
ROUNDS=${ROUNDS:-3}
RATE=${RATE:-1gbit}
BURST=${BURST:-512kb}
CHUNK_ELEMENTS=${CHUNK_ELEMENTS:-0}
COORD_FLAGS=${COORD_FLAGS:-}
BENCH_FLAGS=${BENCH_FLAGS:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/netns-results/$(date +%Y%m%d-%H%M%S)}
STANDBYS=${STANDBYS:-0}
HA_LEASE_TTL=${HA_LEASE_TTL:-2s}

log() { echo "[netns_scaleout] $*" >&2; }
die() { echo "[netns_scaleout] error: $*" >&2; exit 1; }
skip() { echo "[netns_scaleout] SKIP: $*" >&2; exit 77; }

[[ $(id -u) == 0 ]] || skip "needs root (network namespaces, veth, bridge, tc)"
command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
command -v tc >/dev/null || skip "the tc command (iproute2) is not installed"

# --- build -------------------------------------------------------------------
if [[ ! -f $BUILD_DIR/build.ninja ]]; then
  log "configuring $BUILD_DIR ($BUILD_TYPE, no LibTorch, no tests)"
  cmake -S "$REPO" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DLOCALSGD_BUILD_TORCH=OFF -DLOCALSGD_BUILD_TESTS=OFF \
    -DLOCALSGD_BUILD_BENCH=ON >&2 || die "cmake failed"
fi
ninja -C "$BUILD_DIR" localsgd-coordinator sync_bench localsgdctl >&2 ||
  die "build failed (ninja -C $BUILD_DIR localsgd-coordinator sync_bench localsgdctl)"
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
LOCALSGDCTL=$BUILD_DIR/tools/localsgdctl
with_standby=0
for sb in $STANDBYS; do ((sb)) && with_standby=1; done
if ((with_standby)); then
  command -v etcd >/dev/null || skip "STANDBYS has 1 but etcd is not installed (etcd-server)"
fi
SYNC_BENCH=$BUILD_DIR/bench/sync_bench
has_shard_flags=0
# Not `--help | grep -q`: with pipefail, grep's early exit (SIGPIPE to the
# coordinator) would make the test fail.
coordinator_help=$("$COORDINATOR" --help 2>&1 || true)
if [[ $coordinator_help == *--shard_count* ]]; then has_shard_flags=1; fi

mkdir -p "$OUT_DIR"
log "results and logs in $OUT_DIR"

# --- the network ---------------------------------------------------------------
max_s=0
for s in $SHARDS; do ((s > max_s)) && max_s=$s; done
tag="lsgdb$$"
subnet="10.214.$((RANDOM % 254 + 1))"
ns_sw="$tag-sw"
ns_c=() ns_w=() ns_s=() ns_e=()
for ((i = 0; i < max_s; i++)); do ns_c+=("$tag-c$i"); done
for ((r = 0; r < WORLD; r++)); do ns_w+=("$tag-w$r"); done
if ((with_standby)); then
  for ((i = 0; i < max_s; i++)); do ns_s+=("$tag-s$i"); done
  ns_e=("$tag-e")
fi
coordinator_ip() { echo "$subnet.$((1 + $1))"; }
standby_ip() { echo "$subnet.$((50 + $1))"; }
etcd_ip() { echo "$subnet.200"; }
worker_ip() { echo "$subnet.$((100 + $1))"; }

coordinator_pids=()
bench_pid=""
etcd_pid=""
remove_namespaces() {
  local ns pid
  for pid in $bench_pid "${coordinator_pids[@]}" $etcd_pid; do kill -KILL "$pid" 2>/dev/null || true; done
  for ns in "${ns_c[@]}" "${ns_w[@]}" "${ns_s[@]}" "${ns_e[@]}" "$ns_sw"; do
    ip netns list 2>/dev/null | grep -qw -- "$ns" || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    timeout 10 ip netns del "$ns" 2>/dev/null || true
    if ip netns list 2>/dev/null | grep -qw -- "$ns"; then
      log "WARNING: could not delete network namespace $ns"
    fi
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
setup ip netns add "$ns_sw"
setup ip -n "$ns_sw" link add br0 type bridge
setup ip -n "$ns_sw" link set br0 up
# host NS PORT IP: a host namespace wired to the bridge, its link limited to
# RATE both ways (host egress on eth0, host ingress on the switch port).
host() {
  local ns=$1 port=$2 addr=$3
  setup ip netns add "$ns"
  setup ip -n "$ns_sw" link add "$port" type veth peer name eth0 netns "$ns"
  setup ip -n "$ns_sw" link set "$port" master br0
  setup ip -n "$ns_sw" link set "$port" up
  setup ip -n "$ns" addr add "$addr/24" dev eth0
  setup ip -n "$ns" link set eth0 up
  setup ip -n "$ns" link set lo up
  setup ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$BURST" latency 100ms
  setup ip netns exec "$ns_sw" tc qdisc add dev "$port" root tbf rate "$RATE" burst "$BURST" latency 100ms
}
for ((i = 0; i < max_s; i++)); do host "${ns_c[i]}" "p-c$i" "$(coordinator_ip "$i")"; done
for ((r = 0; r < WORLD; r++)); do host "${ns_w[r]}" "p-w$r" "$(worker_ip "$r")"; done
log "network: $max_s coordinator host(s) at $subnet.1-$max_s, $WORLD worker hosts at $subnet.100-$((99 + WORLD)), every link tbf $RATE both ways"
if ((with_standby)); then
  for ((i = 0; i < max_s; i++)); do host "${ns_s[i]}" "p-s$i" "$(standby_ip "$i")"; done
  host "${ns_e[0]}" "p-e" "$(etcd_ip)"
  ip netns exec "${ns_e[0]}" etcd --name bench --data-dir "$OUT_DIR/etcd" \
    --listen-client-urls "http://$(etcd_ip):2379" \
    --advertise-client-urls "http://$(etcd_ip):2379" \
    --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster bench=http://127.0.0.1:2380 >"$OUT_DIR/etcd.log" 2>&1 &
  etcd_pid=$!
  for ((k = 0; k < 300; ++k)); do
    ip netns exec "${ns_e[0]}" env ETCDCTL_API=3 etcdctl \
      --endpoints="$(etcd_ip):2379" endpoint health >/dev/null 2>&1 && break
    kill -0 "$etcd_pid" 2>/dev/null || die "etcd exited at start; see $OUT_DIR/etcd.log"
    sleep 0.1
  done
  log "standbys: one per shard at $subnet.50-$((49 + max_s)), etcd at $(etcd_ip)"
fi
# A host's link counter (bytes): tx or rx of its eth0.
link_bytes() { ip netns exec "$1" cat "/sys/class/net/eth0/statistics/$2_bytes"; }

# --- runs ----------------------------------------------------------------------
results=$OUT_DIR/raw.tsv
: >"$results"
field() { sed -n "s/.*[[:space:]]$2=\([^[:space:]]*\).*/\1/p" <<<" $1"; }

run() {  # S WIRE STANDBY
  local s=$1 wire=$2 sb=${3:-0} i addrs="" rt="s$1-$2-sb${3:-0}"
  if ((s > 1 && !has_shard_flags)); then
    log "S=$s $wire: skipped: localsgd-coordinator has no --shard_index/--shard_count"
    printf '%s\t%s\t%s\tunsupported\n' "$s" "$wire" "$sb" >>"$results"
    return
  fi
  coordinator_pids=()
  # start NS IP NAME SHARD: one coordinator (with a standby: of group $tag-$rt
  # at a fixed port, so that it can advertise its address).
  start_coordinator() {
    local ns=$1 ip=$2 name=$3 i=$4
    local pf=$OUT_DIR/$rt-$name.port
    rm -f "$pf"
    local flags=(--port_file="$pf" --shutdown_grace=2s)
    if ((sb)); then
      flags+=(--listen="$ip:50051" --ha_etcd="$(etcd_ip):2379" --ha_group="$tag-$rt"
        --ha_advertise="$ip:50051" --ha_lease_ttl="$HA_LEASE_TTL")
    else
      flags+=(--listen="$ip:0")
    fi
    if ((s > 1)); then flags+=(--shard_index="$i" --shard_count="$s"); fi
    if "$COORDINATOR" --help 2>&1 | grep -q -- --metrics_listen; then flags+=(--metrics_listen=); fi
    # shellcheck disable=SC2086
    ip netns exec "$ns" "$COORDINATOR" "${flags[@]}" $COORD_FLAGS \
      >"$OUT_DIR/$rt-$name.log" 2>&1 &
    coordinator_pids+=($!)
  }
  wait_port() {  # NAME PID
    local pf=$OUT_DIR/$rt-$1.port k
    for ((k = 0; k < 300; ++k)); do
      [[ -s $pf ]] && return
      kill -0 "$2" 2>/dev/null || die "$1 exited at start; see $OUT_DIR/$rt-$1.log"
      sleep 0.1
    done
    die "$1 wrote no port in 30 s"
  }
  for ((i = 0; i < s; i++)); do start_coordinator "${ns_c[i]}" "$(coordinator_ip "$i")" "c$i" "$i"; done
  for ((i = 0; i < s; i++)); do
    wait_port "c$i" "${coordinator_pids[i]}"
    addrs+="${addrs:+,}$(coordinator_ip "$i"):$(<"$OUT_DIR/$rt-c$i.port")"
  done
  if ((sb)); then
    # The primaries first (each serving once it won its shard's election),
    # then one standby each; the run starts once every standby is in sync.
    local k
    for ((i = 0; i < s; i++)); do
      for ((k = 0; k < 300; ++k)); do
        ip netns exec "${ns_c[i]}" "$LOCALSGDCTL" --target="$(coordinator_ip "$i"):50051" health \
          >/dev/null 2>&1 && break
        sleep 0.1
      done
      ((k < 300)) || die "primary $i does not serve; see $OUT_DIR/$rt-c$i.log"
    done
    for ((i = 0; i < s; i++)); do start_coordinator "${ns_s[i]}" "$(standby_ip "$i")" "s$i" "$i"; done
    for ((i = 0; i < s; i++)); do
      for ((k = 0; k < 300; ++k)); do
        ip netns exec "${ns_c[i]}" "$LOCALSGDCTL" --target="$(coordinator_ip "$i"):50051" status 2>/dev/null |
          grep -q "in sync" && break
        sleep 0.1
      done
      ((k < 300)) || die "standby $i is not in sync after 30 s; see $OUT_DIR/$rt-s$i.log"
    done
    addrs=""
    for ((i = 0; i < s; i++)); do
      addrs+="${addrs:+,}$(coordinator_ip "$i"):50051|$(standby_ip "$i"):50051"
    done
  fi
  local tx0=() rx0=()
  for ((i = 0; i < s; i++)); do
    tx0+=("$(link_bytes "${ns_c[i]}" tx)")
    if ((sb)); then rx0+=("$(link_bytes "${ns_s[i]}" rx)"); fi
  done
  log "S=$s $wire standby=$sb: WORLD=$WORLD ${MILLIONS}M, replicas $addrs"
  local rc=0
  # shellcheck disable=SC2086
  timeout --kill-after=10 $((RUN_TIMEOUT + 30)) "$SYNC_BENCH" \
    --coordinator="$addrs" --worker_netns="$tag-w" --world="$WORLD" \
    --millions="$MILLIONS" --rounds="$ROUNDS" --wire_dtype="$wire" \
    --chunk_elements="$CHUNK_ELEMENTS" --timeout="${RUN_TIMEOUT}s" $BENCH_FLAGS \
    >"$OUT_DIR/$rt.log" 2>&1 &
  bench_pid=$!
  wait "$bench_pid" || rc=$?
  bench_pid=""
  # Bytes over the whole run (seed, warm-up and timed rounds): what the
  # primaries' hosts sent, what the standbys' hosts received.
  local primary_tx=0 standby_rx=0
  for ((i = 0; i < s; i++)); do
    primary_tx=$((primary_tx + $(link_bytes "${ns_c[i]}" tx) - tx0[i]))
    if ((sb)); then standby_rx=$((standby_rx + $(link_bytes "${ns_s[i]}" rx) - rx0[i])); fi
  done
  local rss="" cpu="" pid
  # CPU seconds (user + system) over the whole run: the primaries', then
  # the standbys'.
  for pid in "${coordinator_pids[@]}"; do
    cpu+="${cpu:+,}$(awk -v hz="$(getconf CLK_TCK)" '{ sub(/.*\) /, ""); printf "%.1f", ($12 + $13) / hz }' "/proc/$pid/stat" 2>/dev/null || echo '?')"
  done
  for ((i = 0; i < s; i++)); do
    rss+="${rss:+,}$(awk '/^VmHWM:/ { printf "%.0f", $2 / 1024 }' "/proc/${coordinator_pids[i]}/status" 2>/dev/null || echo '?')"
    kill -TERM "${coordinator_pids[i]}" 2>/dev/null || true
  done
  for pid in "${coordinator_pids[@]:s}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${coordinator_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  coordinator_pids=()
  local line
  line=$(grep '^RESULT ' "$OUT_DIR/$rt.log" || true)
  if ((rc != 0)) || [[ -z $line ]]; then
    tail -n 5 "$OUT_DIR/$rt.log" >&2
    log "S=$s $wire standby=$sb: FAILED (status $rc); see $OUT_DIR/$rt.log"
    printf '%s\t%s\t%s\tfailed\n' "$s" "$wire" "$sb" >>"$results"
    return
  fi
  grep '^sync_bench: ' "$OUT_DIR/$rt.log" | sed 's/^/  /' >&2 || true
  printf '%s\t%s\t%s\t%s rss_mib=%s primary_tx=%s standby_rx=%s cpu_s=%s\n' "$s" "$wire" "$sb" \
    "${line#RESULT }" "$rss" "$primary_tx" "$standby_rx" "$cpu" >>"$results"
}

for wire in $WIRES; do
  for s in $SHARDS; do
    for sb in $STANDBYS; do run "$s" "$wire" "$sb"; done
  done
done

# --- the peer on the same hosts ------------------------------------------------
# accelerate's LocalSGD sync (../shared/bench/peer_accelerate_localsgd.py),
# one gloo rank per worker host (bench/peer_rank.py), over the same links.
PEER_DIR=${PEER_DIR:-$REPO/../shared/bench}
peer_median=""
if [[ ${PEER:-1} != 0 && -f $PEER_DIR/peer_accelerate_localsgd.py ]]; then
  log "peer: accelerate LocalSGD on gloo, rank r on host w<r>, ${MILLIONS}M"
  peer_pids=()
  port=$((29500 + RANDOM % 400))
  for ((r = 0; r < WORLD; r++)); do
    ip netns exec "${ns_w[r]}" env MASTER_ADDR="$(worker_ip 0)" MASTER_PORT="$port" \
      GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
      timeout --kill-after=10 "$RUN_TIMEOUT" /usr/bin/python3 "$REPO/bench/peer_rank.py" \
      "$PEER_DIR" "$r" "$WORLD" "$MILLIONS" "$ROUNDS" >"$OUT_DIR/peer-r$r.log" 2>&1 &
    peer_pids+=($!)
  done
  peer_rc=0
  for pid in "${peer_pids[@]}"; do wait "$pid" || peer_rc=$?; done
  peer_line=$(grep '^peer=' "$OUT_DIR/peer-r0.log" || true)
  if ((peer_rc == 0)) && [[ -n $peer_line ]]; then
    peer_median=$(field "$peer_line" median_s)
    log "peer: $peer_line"
  else
    tail -n 5 "$OUT_DIR/peer-r0.log" >&2
    log "peer: FAILED (status $peer_rc); see $OUT_DIR/peer-r*.log"
  fi
else
  log "peer: skipped (PEER=0, or no $PEER_DIR/peer_accelerate_localsgd.py)"
fi

# --- report --------------------------------------------------------------------
/usr/bin/python3 - "$results" "$RATE" "$WORLD" "$peer_median" <<'EOF' | tee "$OUT_DIR/results.md"
import re, sys
path, rate, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
peer = float(sys.argv[4]) if sys.argv[4] else None
m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
bps = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8 if m else None
rows = [l.rstrip("\n").split("\t") for l in open(path) if l.strip()]
ha = any(sb == "1" for _, _, sb, _ in rows)
print(f"| S | wire |" + (" standby |" if ha else "") +
      " round median s | min s | speed-up vs S=1 | link lower bound s | "
      f"median/lower bound | ours/peer | replica peak RSS MiB | coordinators' CPU s |" +
      (" vs no standby | primaries' tx MB | standbys' rx MB | rx/tx |" if ha else ""))
print("|---:|---|" + ("---|" if ha else "") + "---:|---:|---:|---:|---:|---:|---|---|" +
      ("---:|---:|---:|---:|" if ha else ""))
base, plain = {}, {}
for s, wire, sb, rest in rows:
    sbc = f" {'yes' if sb == '1' else 'no'} |" if ha else ""
    if rest in ("unsupported", "failed"):
        print(f"| {s} | {wire} |{sbc} {rest} | | | | | | | |" + (" | | | |" if ha else "")); continue
    d = dict(t.split("=", 1) for t in rest.split() if "=" in t)
    med, sent, recv = float(d["median_s"]), int(d["bytes_sent"]), int(d["bytes_received"])
    s = int(s)
    if sb == "0":
        base.setdefault(wire, med if s == 1 else None)
        plain[(s, wire)] = med
    lb = max(max(sent, recv), world * max(sent, recv) / s) / bps if bps else None
    sp = f"{base[wire] / med:.2f}" if base.get(wire) else "-"
    vs = f"{med / peer:.2f}" if peer else "-"
    lbs = f"{lb:.3f} | {med / lb:.2f}" if lb else "- | -"
    extra = ""
    if ha:
        tx, rx = int(d.get("primary_tx", 0)), int(d.get("standby_rx", 0))
        ratio = f"{med / plain[(s, wire)]:.2f}x" if sb == "1" and (s, wire) in plain else ""
        extra = (f" {ratio} | {tx / 1e6:,.0f} | {rx / 1e6:,.0f} | "
                 f"{rx / tx:.2f} |" if sb == "1" and tx else f" {ratio} | {tx / 1e6:,.0f} | | |")
    print(f"| {s} | {wire} |{sbc} {med:.3f} | {float(d['min_s']):.3f} | {sp} | "
          f"{lbs} | {vs} | {d.get('rss_mib', '?')} | {d.get('cpu_s', '?')} |{extra}")
print()
print(f"WORLD={world}, every host link tbf {rate} each way; lower bound = busiest link's bytes / rate; "
      "CPU s: each coordinator's user + system seconds over the run (primaries, then standbys).")
if ha:
    print("With a standby: each shard's primary and its standby on hosts of their own, etcd on "
          "another; tx/rx over the whole run (seed, warm-up and timed rounds), "
          "the links' own counters.")
if peer:
    print(f"peer (accelerate LocalSGD on gloo, one rank per worker host, same links): "
          f"median {peer:.3f} s a round.")
EOF
