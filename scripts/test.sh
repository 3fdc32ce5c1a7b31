#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest). CI runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
scripts/build.sh -DLOCALSGD_BUILD_TESTS=ON
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${JOBS:-2}" --timeout 900

# --- lock annotations checked by clang (scripts/thread-safety.sh) ---
scripts/thread-safety.sh

# --- sanitizers (scripts/sanitize.sh) ---
# ASan+UBSan and TSan builds of the tests in build-asan/ and build-tsan/
# (~10 min cold on 2 cores, less with a warm ccache). LOCALSGD_SANITIZE_CI=0
# skips them.
if [[ "${LOCALSGD_SANITIZE_CI:-1}" != 0 ]]; then
  scripts/sanitize.sh
else
  echo "test: sanitizers skipped (LOCALSGD_SANITIZE_CI=0)"
fi
# --- end sanitizers ---

# --- fuzzing (tests/fuzz, scripts/fuzz.sh) ---
# Each libFuzzer target for LOCALSGD_FUZZ_SECONDS (default 60; 0 skips).
run_fuzzers() {
  local secs=${LOCALSGD_FUZZ_SECONDS:-60}
  if [[ "$secs" == 0 ]]; then
    echo "test: fuzzing skipped (LOCALSGD_FUZZ_SECONDS=0)"
    return
  fi
  scripts/fuzz.sh "$secs"
}
run_fuzzers
# --- end fuzzing ---
