#!/usr/bin/env bash
# The installed package, used from outside the tree as a user would:
# `cmake --install` of this build into a temporary prefix, then a separate
# CMake project (tests/install/consumer) that finds it with
# find_package(localsgd CONFIG REQUIRED), links localsgd::client (and
# localsgd::torch where WITH_TORCH=1) and runs two of its workers against the
# installed coordinator; each checks every round against the closed form.
#
#   install_consumer_test.sh BUILD_DIR WITH_TORCH
set -euo pipefail
BUILD=$(cd "$1" && pwd)
WITH_TORCH=$2
SRC=$(cd "$(dirname "$0")" && pwd)
source "$SRC/../e2e/lib.sh"
e2e_init install_consumer

PREFIX=$E2E_TMP/prefix
e2e_log "installing $BUILD into $PREFIX"
cmake --install "$BUILD" --prefix "$PREFIX" --component client >"$E2E_TMP/install.log"
cmake --install "$BUILD" --prefix "$PREFIX" --component coordinator >>"$E2E_TMP/install.log"
# Only the public headers are installed, no coordinator core.
for h in client/client.h src/layout.h src/types.h; do
  [[ -f $PREFIX/include/localsgd/$h ]] || e2e_fail "header $h not installed"
done
for h in src/job.h src/coordinator.h; do
  [[ ! -e $PREFIX/include/localsgd/$h ]] || e2e_fail "core header $h installed"
done
if ls "$PREFIX"/lib*/liblocalsgd_core* >/dev/null 2>&1 ||
   ls "$PREFIX"/lib/*/liblocalsgd_core* >/dev/null 2>&1; then
  e2e_fail "the coordinator core library was installed with the client"
fi

e2e_log "configuring and building the consumer project"
torch_args=(-DCONSUMER_TORCH=OFF)
if [[ $WITH_TORCH == 1 ]]; then
  torch_args=(-DCONSUMER_TORCH=ON)
fi
if ! cmake -S "$SRC/consumer" -B "$E2E_TMP/consumer" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX" \
    "${torch_args[@]}" >"$E2E_TMP/consumer-configure.log" 2>&1; then
  cat "$E2E_TMP/consumer-configure.log"
  e2e_fail "the consumer project does not configure"
  e2e_finish_failed
fi
if ! cmake --build "$E2E_TMP/consumer" -j 2 >"$E2E_TMP/consumer-build.log" 2>&1; then
  cat "$E2E_TMP/consumer-build.log"
  e2e_fail "the consumer project does not build"
  e2e_finish_failed
fi

e2e_start_coordinator coordinator "$PREFIX/bin/localsgd-coordinator"
run_pair() {
  local binary=$1 job=$2 pids=() rc
  for rank in 0 1; do
    "$E2E_TMP/consumer/$binary" "127.0.0.1:$E2E_PORT" "$job" "$rank" 2 3 \
      >"$E2E_TMP/$binary$rank.log" 2>&1 &
    pids+=($!)
  done
  for rank in 0 1; do
    rc=0
    wait "${pids[rank]}" || rc=$?
    if ((rc != 0)); then
      cat "$E2E_TMP/$binary$rank.log"
      e2e_fail "$binary rank $rank exited $rc"
    elif ! grep -q "^rank=$rank round=3 ok" "$E2E_TMP/$binary$rank.log"; then
      e2e_fail "$binary rank $rank did not report round 3"
    fi
  done
}
run_pair consumer_worker consumer-job
if [[ $WITH_TORCH == 1 ]]; then
  run_pair consumer_torch_worker consumer-torch-job
fi

# The Python package, where it is built: installed under the prefix,
# imported from there (not the build tree), two members average a round.
python_ok=""
if [[ -f $BUILD/python/localsgd/__init__.py ]]; then
  cmake --install "$BUILD" --prefix "$PREFIX" --component python >>"$E2E_TMP/install.log"
  site=$PREFIX/lib/python3/dist-packages
  [[ -f $site/localsgd/__init__.py ]] || e2e_fail "the Python package is not installed in $site"
  if ! PYTHONPATH=$site /usr/bin/python3 "$SRC/python_round.py" "127.0.0.1:$E2E_PORT" \
      "$site" installed-python >"$E2E_TMP/python.log" 2>&1; then
    cat "$E2E_TMP/python.log"
    e2e_fail "the installed Python package does not work"
  fi
  python_ok=", the installed Python package averaged a round"
fi
((${#E2E_FAILURES[@]} == 0)) || e2e_finish_failed
e2e_pass "installed package: find_package(localsgd), localsgd::client$([[ $WITH_TORCH == 1 ]] && echo ' and localsgd::torch') workers averaged 3 rounds exactly$python_ok"
