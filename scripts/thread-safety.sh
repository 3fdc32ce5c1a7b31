#!/usr/bin/env bash
# Builds the coordinator core, the server and the client with clang and
# -Wthread-safety -Werror (in build-clang/, no LibTorch, no tests), so that
# the lock annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED,
# ABSL_LOCKS_EXCLUDED) are checked by a compiler: GCC ignores them. CI runs
# this from scripts/test.sh.
#
# Environment: CLANG_BUILD_DIR (build-clang), JOBS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${CLANG_BUILD_DIR:-build-clang}
CC=${CLANG_CC:-clang} CXX=${CLANG_CXX:-clang++} cmake -S . -B "$BUILD" -G Ninja \
  -DCMAKE_BUILD_TYPE=Debug -DLOCALSGD_WERROR=ON -DLOCALSGD_BUILD_TORCH=OFF \
  -DLOCALSGD_BUILD_TESTS=OFF -DLOCALSGD_BUILD_BENCH=OFF >/dev/null
cmake --build "$BUILD" -j "${JOBS:-2}" --target localsgd_core localsgd_server \
  localsgd_client localsgd-coordinator localsgdctl
echo "thread-safety: clang -Wthread-safety -Werror build of core, server and client: OK"
