#!/usr/bin/env bash
# `pip install` from the checkout, as a Python user would: a fresh venv of
# Debian's python3 (--system-site-packages: Debian's setuptools, wheel,
# torch and numpy are visible), `pip install --no-build-isolation SOURCE`
# offline (PIP_NO_INDEX=1), which builds the module with CMake
# (pyproject.toml, setup.py) in BUILD_DIR/pip-build, made afresh; then the
# package imported from the venv (not the build tree), LocalSGD importable,
# one round averaged exactly against the build tree's coordinator
# (python_round.py), and `pip uninstall` removing it again.
#
#   pip_install_test.sh BUILD_DIR SOURCE_DIR COORDINATOR
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SOURCE=$(cd "$2" && pwd)
COORDINATOR=$3
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../e2e/lib.sh"
e2e_init install_pip
e2e_require_executable "$COORDINATOR"

# Nothing from the build tree or the caller's Python settings.
unset PYTHONPATH PYTHONHOME PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
export LOCALSGD_PIP_BUILD_DIR=$BUILD/pip-build
rm -rf "$LOCALSGD_PIP_BUILD_DIR"

VENV=$E2E_TMP/venv
e2e_log "creating $VENV"
if ! /usr/bin/python3 -m venv --system-site-packages "$VENV" >"$E2E_TMP/venv.log" 2>&1; then
  e2e_die "/usr/bin/python3 -m venv failed (Debian: python3-venv)"
fi
e2e_log "pip install --no-build-isolation $SOURCE (offline; CMake builds _localsgd)"
if ! (cd "$E2E_TMP" && "$VENV/bin/pip" install --no-build-isolation -v "$SOURCE") \
    >"$E2E_TMP/pip.log" 2>&1; then
  tail -n 60 "$E2E_TMP/pip.log" >&2
  e2e_die "pip install failed (log above: $E2E_TMP/pip.log)"
fi
grep -q -- "--target _localsgd" "$E2E_TMP/pip.log" ||
  e2e_fail "pip's build did not build the CMake target _localsgd"
if command -v ninja >/dev/null; then
  [[ -f $LOCALSGD_PIP_BUILD_DIR/build.ninja ]] ||
    e2e_fail "the pip build did not use Ninja"
fi
# setuptools' files stay in the pip build directory, not in the checkout.
for stray in "$SOURCE/python/localsgd.egg-info" "$SOURCE/localsgd.egg-info"; do
  [[ ! -e $stray ]] || e2e_fail "the pip build wrote $stray"
done

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
ext=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for f in __init__.py local_sgd.py "_localsgd$ext"; do
  [[ -f $site/localsgd/$f ]] || e2e_fail "the wheel did not install localsgd/$f in $site"
done
e2e_check

cd "$E2E_TMP"
if ! "$VENV/bin/python" -c 'from localsgd import LocalSGD, Client, Error' \
    >"$E2E_TMP/import.log" 2>&1; then
  e2e_fail "from localsgd import LocalSGD fails in the venv"
fi
e2e_start_coordinator coordinator "$COORDINATOR"
if ! "$VENV/bin/python" "$HERE/python_round.py" "127.0.0.1:$E2E_PORT" "$site" \
    pip-python >"$E2E_TMP/python.log" 2>&1; then
  e2e_fail "the pip-installed package does not average a round"
fi
version=$("$VENV/bin/pip" show localsgd | sed -n 's/^Version: //p')
"$VENV/bin/pip" uninstall -y localsgd >"$E2E_TMP/uninstall.log" 2>&1 ||
  e2e_fail "pip uninstall localsgd failed"
[[ ! -e $site/localsgd ]] || e2e_fail "pip uninstall left $site/localsgd"
e2e_check
e2e_pass "pip install --no-build-isolation (offline) built and installed localsgd $version into a venv; it averaged a round exactly; pip uninstall removed it"
