#!/usr/bin/env bash
# Installs what is missing and builds everything into $BUILD_DIR (default build/).
# Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" "$@"
# Two jobs: LibTorch translation units take ~1.5 GiB each and this is a 2-core machine.
cmake --build "$BUILD_DIR" -j "${JOBS:-2}"
