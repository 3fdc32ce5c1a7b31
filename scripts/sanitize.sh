#!/usr/bin/env bash
# Builds the tests with sanitizers, each in its own build folder without
# LibTorch, and runs them; any sanitizer report fails the run. CI runs this
# from scripts/test.sh (LOCALSGD_SANITIZE_CI=0 skips it there).
#
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer + LeakSanitizer, in
#         build-asan/: the core, client, integration and security tests
#         (labels),
#         and deploy_health_drain (coordinator, scripted members, localsgdctl
#         as processes: drain on SIGTERM, restart).
#   tsan  ThreadSanitizer, in build-tsan/: the core tests (label core): the
#         job, coordinator, checkpointer, checkpoint store and drain tests run
#         their threads against the real locks. Debian's Abseil is not built
#         with TSan; tests/sanitizers/tsan_absl_mutex.cc makes absl::Mutex
#         visible to it. The gRPC tests are not run under TSan: Debian's gRPC
#         is not instrumented and orders its callbacks and reuses its call
#         arenas through synchronisation TSan cannot see, which gives
#         hundreds of false reports per run (tests/sanitizers/README.md).
#
# Environment: SANITIZERS (default "asan tsan"), ASAN_BUILD_DIR (build-asan),
# TSAN_BUILD_DIR (build-tsan), JOBS (2).
# Extra arguments go to ctest for the gtest suites (e.g. -R DrainTest to run
# fewer; deploy_health_drain then is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
SANITIZERS=${SANITIZERS:-asan tsan}
JOBS=${JOBS:-2}
SUPPRESSIONS=$PWD/tests/sanitizers

# Every report fails the test that made it: stop at the first one, with an
# exit code no test uses on purpose. Suppressions (tests/sanitizers/*.supp)
# only for reports that are not ours; each says why.
supp() {
  if [[ -f $SUPPRESSIONS/$1.supp ]]; then echo ":suppressions=$SUPPRESSIONS/$1.supp"; fi
}
export ASAN_OPTIONS="halt_on_error=1:exitcode=23:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:strict_string_checks=1$(supp asan)"
export LSAN_OPTIONS="exitcode=23$(supp lsan)"
export UBSAN_OPTIONS="halt_on_error=1:exitcode=23:print_stacktrace=1$(supp ubsan)"
export TSAN_OPTIONS="halt_on_error=1:exitcode=23:second_deadlock_stack=1:history_size=4$(supp tsan)"

# build DIR SANITIZE OPT TARGETS...: configures a sanitizer build folder (no
# LibTorch, no benchmarks) and builds the targets.
# OPT: optimisation and debug info. -g1 (line tables) is all a report's
# stack needs; it and a low -O halve the compile time of -O2 -g (which is
# what the sanitizers cost most here: a cold build is ~2/3 of the run).
build() {
  local dir=$1 sanitize=$2 opt=$3
  shift 3
  echo "[sanitize] $sanitize ($opt) in $dir: building $*"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt -DNDEBUG" \
    -DLOCALSGD_BUILD_TORCH=OFF -DLOCALSGD_BUILD_TESTS=ON \
    -DLOCALSGD_BUILD_BENCH=OFF -DLOCALSGD_SANITIZE="$sanitize" >/dev/null
  cmake --build "$dir" -j "$JOBS" --target "$@"
}

# check DIR CTEST_ARGS...: runs the selected tests.
check() {
  local dir=$1
  shift
  ctest --test-dir "$dir" --output-on-failure -j "$JOBS" --timeout 300 \
    --no-tests=error "$@"
}

EXTRA=("$@")
for s in $SANITIZERS; do
  t0=$SECONDS
  case $s in
    asan)
      dir=${ASAN_BUILD_DIR:-build-asan}
      build "$dir" address,undefined "-Og -g1" tests/core/all \
        tests/client/all tests/integration/all tests/security/all \
        localsgd-coordinator localsgdctl scripted_member
      t1=$SECONDS
      check "$dir" -L '^(core|client|integration|security)$' "${EXTRA[@]}"
      if [[ ${#EXTRA[@]} -eq 0 ]]; then
        check "$dir" -R '^deploy_health_drain$'
      fi
      ;;
    tsan)
      dir=${TSAN_BUILD_DIR:-build-tsan}
      build "$dir" thread "-O1 -g1" tests/core/all
      t1=$SECONDS
      check "$dir" -L '^core$' "${EXTRA[@]}"
      ;;
    *)
      echo "[sanitize] unknown sanitizer '$s' (asan, tsan)" >&2
      exit 2
      ;;
  esac
  echo "[sanitize] $s: OK (build $((t1 - t0)) s, tests $((SECONDS - t1)) s)"
done
