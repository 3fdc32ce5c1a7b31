#!/usr/bin/env bash
# The Debian packages (CPack, CMakeLists.txt) as a user installs them: built
# with `cpack -G DEB` from this build, checked (names, contents, Depends),
# installed into the machine with dpkg -i (dependencies already present:
# dpkg refuses the install otherwise), then used from /usr only: the
# coordinator and localsgdctl from /usr/bin, a C++ consumer project built
# with find_package(localsgd) from /usr/lib/cmake (tests/install/consumer)
# averaging 3 rounds against it, and the Python package imported by
# /usr/bin/python3 from /usr/lib/python3/dist-packages without PYTHONPATH
# averaging a round. The packages are removed (dpkg -r) at exit.
#
# Needs root and a free dpkg lock; skipped (77) otherwise, or if a localsgd
# package is already installed (it is not replaced).
#
#   deb_test.sh BUILD_DIR
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")" && pwd)
source "$SRC/../e2e/lib.sh"
e2e_init deb_packages

if [[ $(id -u) -ne 0 ]]; then
  e2e_log "SKIP: dpkg -i needs root"
  exit 77
fi
PACKAGES=(localsgd-coordinator localsgd-client-dev python3-localsgd localsgd-worker)
for p in "${PACKAGES[@]}"; do
  if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    e2e_log "SKIP: $p is installed already; not replacing it (dpkg -r $p to run this test)"
    exit 77
  fi
done

e2e_log "cpack -G DEB"
if ! (cd "$BUILD" && cpack -G DEB -B "$E2E_TMP/debs") >"$E2E_TMP/cpack.log" 2>&1; then
  cat "$E2E_TMP/cpack.log"
  e2e_die "cpack failed"
fi
declare -A deb listing
for f in "$E2E_TMP"/debs/*.deb; do
  p=$(dpkg-deb -f "$f" Package)
  deb[$p]=$f
  listing[$p]=$(dpkg-deb -c "$f")
done
for p in localsgd-coordinator localsgd-client-dev; do
  [[ -n ${deb[$p]:-} ]] || e2e_die "no $p package (got: ${!deb[*]})"
done
contains() { grep -q -- "$2" <<< "${listing[$1]}" || e2e_fail "$1 lacks $2"; }
contains localsgd-coordinator ' ./usr/bin/localsgd-coordinator$'
contains localsgd-coordinator ' ./usr/bin/localsgdctl$'
contains localsgd-client-dev ' ./usr/include/localsgd/client/client.h$'
contains localsgd-client-dev ' ./usr/lib/cmake/localsgd/localsgdConfig.cmake$'
if grep -q 'src/job.h\|liblocalsgd_core' <<< "${listing[localsgd-client-dev]}"; then
  e2e_fail "the client package holds the coordinator core"
fi
grep -q 'libgrpc++1.51' <<< "$(dpkg-deb -f "${deb[localsgd-coordinator]}" Depends)" ||
  e2e_fail "localsgd-coordinator does not depend on libgrpc++1.51: $(dpkg-deb -f "${deb[localsgd-coordinator]}" Depends)"
if [[ -n ${deb[python3-localsgd]:-} ]]; then
  contains python3-localsgd ' ./usr/lib/python3/dist-packages/localsgd/__init__.py$'
  contains python3-localsgd ' ./usr/lib/python3/dist-packages/localsgd/_localsgd.*\.so$'
fi
e2e_check
for p in "${!deb[@]}"; do
  e2e_log "$p: $(dpkg-deb -f "${deb[$p]}" Version) $(du -k "${deb[$p]}" | cut -f1) KiB; Depends: $(dpkg-deb -f "${deb[$p]}" Depends)"
done

e2e_log "dpkg -i ${!deb[*]}"
e2e_at_exit "dpkg -r ${!deb[*]} >>'$E2E_TMP/dpkg.log' 2>&1 || echo 'dpkg -r failed' >&2"
if ! dpkg -i "${deb[@]}" >"$E2E_TMP/dpkg.log" 2>&1; then
  cat "$E2E_TMP/dpkg.log"
  e2e_die "dpkg -i failed"
fi

e2e_start_coordinator coordinator /usr/bin/localsgd-coordinator
/usr/bin/localsgdctl --target="127.0.0.1:$E2E_PORT" health >/dev/null ||
  e2e_fail "localsgdctl health on the installed coordinator"

e2e_log "building the consumer project against /usr"
if ! cmake -S "$SRC/consumer" -B "$E2E_TMP/consumer" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCONSUMER_TORCH=OFF \
    >"$E2E_TMP/consumer-configure.log" 2>&1 ||
   ! cmake --build "$E2E_TMP/consumer" -j 2 >"$E2E_TMP/consumer-build.log" 2>&1; then
  cat "$E2E_TMP/consumer-configure.log" "$E2E_TMP/consumer-build.log" 2>/dev/null | tail -40
  e2e_die "the consumer project does not build against the installed package"
fi
grep -q "/usr/lib/cmake/localsgd" "$E2E_TMP/consumer/CMakeCache.txt" ||
  e2e_fail "the consumer did not find the package in /usr/lib/cmake/localsgd"
pids=()
for rank in 0 1; do
  "$E2E_TMP/consumer/consumer_worker" "127.0.0.1:$E2E_PORT" deb-job "$rank" 2 3 \
    >"$E2E_TMP/consumer$rank.log" 2>&1 &
  pids+=($!)
done
for rank in 0 1; do
  rc=0
  wait "${pids[rank]}" || rc=$?
  ((rc == 0)) && grep -q "^rank=$rank round=3 ok" "$E2E_TMP/consumer$rank.log" ||
    { cat "$E2E_TMP/consumer$rank.log"; e2e_fail "consumer rank $rank (exit $rc)"; }
done

python_ok=""
if [[ -n ${deb[python3-localsgd]:-} ]]; then
  if ! env -u PYTHONPATH /usr/bin/python3 "$SRC/python_round.py" \
      "127.0.0.1:$E2E_PORT" /usr/lib/python3/dist-packages deb-python \
      >"$E2E_TMP/python.log" 2>&1; then
    cat "$E2E_TMP/python.log"
    e2e_fail "the installed python3-localsgd does not work"
  fi
  python_ok="; python3-localsgd imported from /usr/lib/python3/dist-packages averaged a round"
fi
e2e_check
e2e_pass "debs ${!deb[*]} installed with dpkg -i: coordinator and localsgdctl from /usr/bin, a C++ consumer built with find_package(localsgd) averaged 3 rounds$python_ok"
