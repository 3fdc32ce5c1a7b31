#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang and runs each for
# SECONDS (default 60), starting from the committed seed corpus
# (tests/fuzz/corpus/<target>) plus what earlier runs found
# ($FUZZ_BUILD_DIR/fuzz-corpus/<target>). Prints executions and coverage per
# target; fails if a target crashes, times out or runs out of memory, and
# keeps the input that did it in $FUZZ_BUILD_DIR/fuzz-artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS]
#
# Environment:
#   FUZZ_BUILD_DIR  build folder (default build-fuzz)
#   FUZZ_TARGETS    targets to run (default "sync join fetch_state chunk_wire sync_client replica
#                   sparse_codec")
#   FUZZ_FLAGS      more libFuzzer flags, e.g. "-max_len=4096"
#   FUZZ_RSS_MB     memory limit per target (default 2048)
#
# Reproduce a crash:  $FUZZ_BUILD_DIR/tests/fuzz/<target>_fuzzer <crash file>
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
TARGETS=${FUZZ_TARGETS:-"sync join fetch_state chunk_wire sync_client replica sparse_codec"}
RSS_MB=${FUZZ_RSS_MB:-2048}

if [[ ! -f "$BUILD/CMakeCache.txt" ]] ||
   ! grep -q '^LOCALSGD_BUILD_FUZZERS:BOOL=ON' "$BUILD/CMakeCache.txt"; then
  CC=${FUZZ_CC:-clang} CXX=${FUZZ_CXX:-clang++} cmake -S . -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOCALSGD_BUILD_TESTS=ON \
    -DLOCALSGD_BUILD_TORCH=OFF -DLOCALSGD_BUILD_FUZZERS=ON
fi
build_targets=()
for t in $TARGETS; do build_targets+=("${t}_fuzzer"); done
cmake --build "$BUILD" -j "${JOBS:-2}" --target "${build_targets[@]}"

failed=0
report=()
for t in $TARGETS; do
  bin="$BUILD/tests/fuzz/${t}_fuzzer"
  corpus="$BUILD/fuzz-corpus/$t"
  artifacts="$BUILD/fuzz-artifacts/$t"
  log="$BUILD/fuzz-logs/$t.log"
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s (log $log)"
  rc=0
  # New inputs go to the first corpus folder, never to the committed one.
  "$bin" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 \
    -rss_limit_mb="$RSS_MB" -print_final_stats=1 \
    -artifact_prefix="$artifacts/" ${FUZZ_FLAGS:-} \
    "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
  result=ok
  if ((rc != 0)); then
    failed=1
    result="FAILED (exit $rc)"
    echo "fuzz: $t failed; the end of its log:"
    tail -n 40 "$log"
    for f in "$artifacts"/*; do
      [[ -e "$f" ]] && echo "fuzz: input kept: $f"
    done
  fi
  report+=("$(printf '%-12s %6ss %12s execs %8s/s  cov %6s  ft %7s  corpus %6s  %s' \
    "$t" "$SECONDS_PER_TARGET" "${execs:-?}" "${rate:-?}" "${cov:-?}" \
    "${ft:-?}" "${corp:-?}" "$result")")
done

echo "fuzz: summary"
printf '  %s\n' "${report[@]}"
exit "$failed"
