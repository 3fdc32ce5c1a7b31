#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest). CI runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
scripts/build.sh -DLOCALSGD_BUILD_TESTS=ON
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${JOBS:-2}" --timeout 900
