#!/usr/bin/env bash
# The sync-round benchmark: localsgd against accelerate's LocalSGD on
# torch.distributed/gloo, side by side on this machine, in one invocation.
# Not part of ctest. See bench/README.md for what each column means.
#
# Usage:
#   bench/sync_round.sh            # the full grid: WORLD 2,4,8 x 10M,25M x
#                                  # fp32,bf16, plus coordinator RSS at
#                                  # WORLD 4,8,16,32 for 25M fp32
#   bench/sync_round.sh --quick    # WORLD=4, 25M, fp32 and bf16 only (= QUICK=1)
#   bench/sync_round.sh --help
#
# It builds what it needs (localsgd-coordinator, sync_bench, loopback_bw,
# reducer_bench) with cmake/ninja into BUILD_DIR, installs Debian's
# python3-torch for the peer if `import torch` fails (scripts/install-deps.sh
# with LOCALSGD_WITH_PEER=1; needs root or sudo), then runs, in order:
#   1. loopback_bw: TCP bandwidth over 127.0.0.1, 1 stream and WORLD streams;
#   2. reducer_bench: the reducer kernels against memcpy;
#   3. for each (WORLD, params): the peer once, then for each wire dtype a
#      fresh coordinator, sync_bench (WORLD workers, 1 warm-up + ROUNDS timed
#      rounds, then a late joiner's FetchState), the coordinator's VmHWM;
#   4. the RSS table: WORLD in RSS_WORLDS at RSS_MILLIONS, fp32, ours only.
# and prints markdown tables (also written to OUT_DIR/results.md).
#
# Environment (defaults in brackets):
#   BUILD_DIR [<repo>/build-bench]  configured here if it has no build.ninja,
#       with BUILD_TYPE [Release] (what deploy/Dockerfile ships), no LibTorch,
#       no tests; an existing build dir keeps its own build type (printed).
#   ROUNDS [5]          timed rounds per configuration (after 1 warm-up round)
#   QUICK [0]           1: WORLDS=4 MILLIONS=25 RSS_WORLDS="" (no RSS table)
#   WORLDS ["2 4 8"]  MILLIONS ["10 25"]  WIRES ["float32 bfloat16"]
#   RSS_WORLDS ["4 8 16 32"]  RSS_MILLIONS [25]  RSS_ROUNDS [2]
#   PEER [1]            0: skip the peer (its columns show "-")
#   PEER_MAX_WORLD [64] the peer runs only up to this WORLD (a process of
#                       PyTorch per rank: 256 of them do not fit in 24 GiB)
#   PEER_SCRIPT [<repo>/../shared/bench/peer_accelerate_localsgd.py]
#   FETCH [1]           0: no late-joiner fetch measurement
#   REDUCER [1]         0: skip the reducer benchmark
#   LOOPBACK_BYTES [4294967296]  bytes each loopback_bw run moves
#   CHUNK_ELEMENTS [0]  chunk size the job asks for (0: coordinator default)
#   COORD_FLAGS []      extra localsgd-coordinator flags
#   BENCH_FLAGS []      extra sync_bench flags (the workers)
#   RUN_TIMEOUT [900]   seconds any one run (peer, sync_bench) may take
#   OUT_DIR [<BUILD_DIR>/bench-results/<date>]  logs, raw results, results.md
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
for arg in "$@"; do
  case $arg in
    --quick) QUICK=1 ;;
    --full) QUICK=0 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "sync_round: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

QUICK=${QUICK:-0}
BUILD_DIR=${BUILD_DIR:-$REPO/build-bench}
BUILD_TYPE=${BUILD_TYPE:-Release}
ROUNDS=${ROUNDS:-5}
if ((QUICK)); then
  WORLDS=${WORLDS:-4}; MILLIONS=${MILLIONS:-25}; RSS_WORLDS=${RSS_WORLDS-}
else
  WORLDS=${WORLDS:-2 4 8}; MILLIONS=${MILLIONS:-10 25}
  RSS_WORLDS=${RSS_WORLDS-4 8 16 32}
fi
WIRES=${WIRES:-float32 bfloat16}
RSS_MILLIONS=${RSS_MILLIONS:-25}
RSS_ROUNDS=${RSS_ROUNDS:-2}
PEER=${PEER:-1}
PEER_MAX_WORLD=${PEER_MAX_WORLD:-64}
PEER_SCRIPT=${PEER_SCRIPT:-$REPO/../shared/bench/peer_accelerate_localsgd.py}
FETCH=${FETCH:-1}
REDUCER=${REDUCER:-1}
LOOPBACK_BYTES=${LOOPBACK_BYTES:-4294967296}
CHUNK_ELEMENTS=${CHUNK_ELEMENTS:-0}
COORD_FLAGS=${COORD_FLAGS:-}
BENCH_FLAGS=${BENCH_FLAGS:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/bench-results/$(date +%Y%m%d-%H%M%S)}

log() { echo "[sync_round] $*" >&2; }
die() { echo "[sync_round] error: $*" >&2; exit 1; }

# --- processes we started: stopped on any exit -------------------------------
coordinator_pid=""
current_pid=""  # a `timeout` running in the background, see bounded()
cleanup() {
  local pid
  for pid in $current_pid $coordinator_pid; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $current_pid $coordinator_pid; do
    wait "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# bounded SECONDS LOG CMD...: runs CMD under `timeout` (which signals CMD's
# whole process group, the peer's spawned workers included), stdout+stderr to
# LOG; returns CMD's status (124 on timeout). In the background so that the
# traps above can stop it.
bounded() {
  local secs=$1 out=$2 rc=0
  shift 2
  timeout --kill-after=10 "$secs" "$@" >"$out" 2>&1 &
  current_pid=$!
  wait "$current_pid" || rc=$?
  current_pid=""
  return "$rc"
}

# interruptible CMD...: runs CMD (output to stderr) in the background and waits,
# so that a signal reaches the traps at once, not after CMD.
interruptible() {
  local rc=0
  "$@" >&2 &
  current_pid=$!
  wait "$current_pid" || rc=$?
  current_pid=""
  return "$rc"
}

# --- build -------------------------------------------------------------------
command -v cmake >/dev/null || die "cmake not found; run scripts/install-deps.sh"
command -v ninja >/dev/null || die "ninja not found; run scripts/install-deps.sh"
if [[ ! -f $BUILD_DIR/build.ninja ]]; then
  log "configuring $BUILD_DIR ($BUILD_TYPE, no LibTorch, no tests)"
  interruptible cmake -S "$REPO" -B "$BUILD_DIR" -G Ninja \
    -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DLOCALSGD_BUILD_TORCH=OFF \
    -DLOCALSGD_BUILD_TESTS=OFF -DLOCALSGD_BUILD_BENCH=ON || die "cmake failed"
fi
targets=(localsgd-coordinator sync_bench loopback_bw)
if ((REDUCER)); then targets+=(reducer_bench); fi
log "building ${targets[*]} in $BUILD_DIR"
interruptible ninja -C "$BUILD_DIR" "${targets[@]}" ||
  die "build failed (ninja -C $BUILD_DIR ${targets[*]}); reducer_bench needs libbenchmark-dev (REDUCER=0 skips it)"
COORDINATOR=$BUILD_DIR/server/localsgd-coordinator
SYNC_BENCH=$BUILD_DIR/bench/sync_bench
LOOPBACK_BW=$BUILD_DIR/bench/loopback_bw
REDUCER_BENCH=$BUILD_DIR/bench/reducer_bench
for bin in "$COORDINATOR" "$SYNC_BENCH" "$LOOPBACK_BW"; do
  [[ -x $bin ]] || die "$bin missing after the build"
done
build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt")

# --- the peer's dependencies -------------------------------------------------
if ((PEER)); then
  [[ -f $PEER_SCRIPT ]] || die "peer script $PEER_SCRIPT not found (PEER_SCRIPT=..., or PEER=0)"
  if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    log "python3-torch missing: LOCALSGD_WITH_PEER=1 scripts/install-deps.sh"
    LOCALSGD_WITH_PEER=1 interruptible "$REPO/scripts/install-deps.sh" ||
      die "installing python3-torch failed (PEER=0 skips the peer)"
    /usr/bin/python3 -c 'import torch' || die "import torch still fails"
  fi
fi

mkdir -p "$OUT_DIR"
raw=$OUT_DIR/raw.tsv  # kind, then key=value fields
: >"$raw"
log "results and logs in $OUT_DIR"
{
  echo "# sync_round $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# build $BUILD_DIR ($build_type), git $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo '+dirty')"
  echo "# ROUNDS=$ROUNDS CHUNK_ELEMENTS=$CHUNK_ELEMENTS COORD_FLAGS='$COORD_FLAGS' BENCH_FLAGS='$BENCH_FLAGS'"
} >"$OUT_DIR/header.txt"

# field LINE KEY: the value of KEY=value in LINE.
field() { sed -n "s/.*[[:space:]]$2=\([^[:space:]]*\).*/\1/p" <<<" $1"; }

# --- coordinator -------------------------------------------------------------
coordinator_port=""
start_coordinator() {  # NAME
  local port_file=$OUT_DIR/$1.port
  rm -f "$port_file"
  local flags=(--listen=127.0.0.1:0 --port_file="$port_file" --shutdown_grace=2s)
  if "$COORDINATOR" --help 2>&1 | grep -q -- --metrics_listen; then
    flags+=(--metrics_listen=)
  fi
  # shellcheck disable=SC2086  # COORD_FLAGS is a list of flags
  "$COORDINATOR" "${flags[@]}" $COORD_FLAGS >"$OUT_DIR/$1.coordinator.log" 2>&1 &
  coordinator_pid=$!
  local i
  for ((i = 0; i < 300; ++i)); do
    [[ -s $port_file ]] && break
    kill -0 "$coordinator_pid" 2>/dev/null ||
      die "coordinator exited at start; see $OUT_DIR/$1.coordinator.log"
    sleep 0.1
  done
  [[ -s $port_file ]] || die "coordinator wrote no port in 30 s; see $OUT_DIR/$1.coordinator.log"
  coordinator_port=$(<"$port_file")
}
stop_coordinator() {
  [[ -n $coordinator_pid ]] || return 0
  kill -TERM "$coordinator_pid" 2>/dev/null || true
  local i
  for ((i = 0; i < 150; ++i)); do
    kill -0 "$coordinator_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$coordinator_pid" 2>/dev/null || true
  wait "$coordinator_pid" 2>/dev/null || true
  coordinator_pid=""
}

# run_ours NAME WORLD MILLIONS WIRE ROUNDS FETCH: one sync_bench run against a
# fresh coordinator; appends its RESULT to raw.tsv with kind NAME.
run_ours() {
  local name=$1 world=$2 millions=$3 wire=$4 rounds=$5 fetch=$6
  local tag=$name-w$world-m$millions-$wire
  start_coordinator "$tag"
  local flags=(--coordinator="127.0.0.1:$coordinator_port" --world="$world"
    --millions="$millions" --rounds="$rounds" --wire_dtype="$wire"
    --chunk_elements="$CHUNK_ELEMENTS" --coordinator_pid="$coordinator_pid"
    --timeout="${RUN_TIMEOUT}s")
  if ((fetch)); then flags+=(--fetch); fi
  log "ours: WORLD=$world ${millions}M $wire ($rounds rounds)"
  local rc=0
  # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
  bounded $((RUN_TIMEOUT + 30)) "$OUT_DIR/$tag.log" \
    "$SYNC_BENCH" "${flags[@]}" $BENCH_FLAGS || rc=$?
  stop_coordinator
  local line
  line=$(grep '^RESULT ' "$OUT_DIR/$tag.log" || true)
  if ((rc != 0)) || [[ -z $line ]]; then
    tail -n 20 "$OUT_DIR/$tag.log" >&2
    die "sync_bench failed (status $rc); see $OUT_DIR/$tag.log"
  fi
  grep '^sync_bench: ' "$OUT_DIR/$tag.log" | sed 's/^/  /' >&2 || true
  printf '%s\t%s\n' "$name" "${line#RESULT }" >>"$raw"
}

run_peer() {  # WORLD MILLIONS
  local world=$1 millions=$2 tag=peer-w$1-m$2 port rc=0
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  log "peer: WORLD=$world ${millions}M fp32 ($ROUNDS rounds)"
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port bounded "$RUN_TIMEOUT" "$OUT_DIR/$tag.log" \
    /usr/bin/python3 "$PEER_SCRIPT" "$world" "$millions" "$ROUNDS" || rc=$?
  local line
  line=$(grep '^peer=' "$OUT_DIR/$tag.log" || true)
  if ((rc != 0)) || [[ -z $line ]]; then
    tail -n 20 "$OUT_DIR/$tag.log" >&2
    die "the peer failed (status $rc); see $OUT_DIR/$tag.log (PEER=0 skips it)"
  fi
  log "  $line"
  printf 'peer\tworld=%s millions=%s %s\n' "$world" "$millions" "$line" >>"$raw"
}

# --- 1. loopback bandwidth ---------------------------------------------------
# shellcheck disable=SC2086  # WORLDS is a list
streams_list=$(printf '%s\n' 1 $WORLDS | sort -n -u | tr '\n' ' ')
for s in $streams_list; do
  log "loopback_bw: $LOOPBACK_BYTES bytes over $s stream(s)"
  bounded "$RUN_TIMEOUT" "$OUT_DIR/loopback-$s.log" \
    "$LOOPBACK_BW" --bytes="$LOOPBACK_BYTES" --streams="$s" ||
    die "loopback_bw failed; see $OUT_DIR/loopback-$s.log"
  line=$(grep '^RESULT ' "$OUT_DIR/loopback-$s.log")
  log "  ${line#RESULT }"
  printf 'loopback\t%s\n' "${line#RESULT }" >>"$raw"
done

# --- 2. reducer ----------------------------------------------------------------
if ((REDUCER)); then
  log "reducer_bench"
  bounded "$RUN_TIMEOUT" "$OUT_DIR/reducer.log" "$REDUCER_BENCH" \
    --benchmark_out="$OUT_DIR/reducer.json" --benchmark_out_format=json ||
    die "reducer_bench failed; see $OUT_DIR/reducer.log"
fi

# --- 3. the grid ---------------------------------------------------------------
for world in $WORLDS; do
  for millions in $MILLIONS; do
    if ((PEER && world <= PEER_MAX_WORLD)); then run_peer "$world" "$millions"; fi
    for wire in $WIRES; do
      run_ours grid "$world" "$millions" "$wire" "$ROUNDS" "$FETCH"
    done
  done
done

# --- 4. coordinator RSS against WORLD -----------------------------------------
for world in $RSS_WORLDS; do
  run_ours rss "$world" "$RSS_MILLIONS" float32 "$RSS_ROUNDS" 0
done

# --- report --------------------------------------------------------------------
/usr/bin/python3 "$REPO/bench/sync_round_report.py" "$raw" \
  "$OUT_DIR/reducer.json" "$OUT_DIR/header.txt" >"$OUT_DIR/results.md"
cat "$OUT_DIR/results.md"
log "written to $OUT_DIR/results.md"
