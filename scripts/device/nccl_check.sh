#!/usr/bin/env bash
# The NCCL node-local path, for real, on a GPU machine: builds the
# coordinator, the LibTorch client and node_tests against the machine's pip
# LibTorch (CUDA, NCCL) and Debian 12's gRPC/protobuf/Abseil/glog from
# .device-bundle (scripts/device/make_bundle.sh), then runs every node_test:
# the NodeGroupCudaTest cases must run there, not skip.
#
#   bash scripts/device/nccl_check.sh      # from the repository root
#
# Logs go to $OUT (default ./nccl-check-out): env.txt, configure.log,
# build.log, node_tests.log, node_tests.xml, ctest.log, summary.txt. The
# last line printed is the summary: "NCCL_CHECK: PASS ..." or
# "NCCL_CHECK: FAIL (<stage>) ...". Nothing is installed outside the
# repository and $OUT.
#
# For checking the bundle mechanics off the GPU machine (e.g. on Debian 12):
#   NCCL_CHECK_CONFIGURE_ONLY=1 NCCL_CHECK_TORCH_DIR=<dir of TorchConfig.cmake>
# configures with that LibTorch, checks that protobuf, gRPC, Abseil, glog,
# ... come from the bundle, and stops.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-$REPO/nccl-check-out}
mkdir -p "$OUT"
BUILD=${BUILD_DIR:-$REPO/build-nccl}
BUNDLE=$REPO/.device-bundle
R=$BUNDLE/root/usr
L=$R/lib/x86_64-linux-gnu
JOBS=${JOBS:-$(nproc)}
START=$SECONDS

summary() {  # summary <PASS|FAIL> <text>
  local line="NCCL_CHECK: $1 $2 ($((SECONDS - START)) s)"
  echo "$line" >"$OUT/summary.txt"
  echo
  echo "$line"
}
fail() {  # fail <stage> <text> [log]
  if [[ $# -ge 3 && -f "$3" ]]; then
    echo "--- last lines of $(basename "$3") ---"
    tail -n 60 "$3"
  fi
  summary FAIL "($1) $2"
  exit 1
}

[[ -d "$L" ]] || fail bundle "no $L: carry .device-bundle (scripts/device/make_bundle.sh)"

# --- environment ---
if [[ -n "${NCCL_CHECK_TORCH_DIR:-}" ]]; then
  TORCH=$(realpath "$NCCL_CHECK_TORCH_DIR/../../..")
else
  TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))') ||
    fail env "python3 cannot import torch"
fi
SITE=$(dirname "$TORCH")
NVCC=$(command -v nvcc || true)
[[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
NCCL_INC=""
for d in "$SITE"/nvidia/nccl/include "$SITE"/nvidia/*/include; do
  if [[ -f "$d/nccl.h" ]]; then NCCL_INC=$d; break; fi
done
GTEST_CONFIG=""
for d in /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/cmake/GTest /usr/local/lib/cmake/GTest /usr/local/lib/x86_64-linux-gnu/cmake/GTest /usr/lib64/cmake/GTest; do
  if [[ -f "$d/GTestConfig.cmake" ]]; then GTEST_CONFIG=$d; break; fi
done
# CMake configs of another protobuf/absl/gRPC/glog on the machine: ignored
# (CMAKE_IGNORE_PATH), so that only the bundle's are found.
IGNORE=""
while IFS= read -r f; do
  case "$f" in "$BUNDLE"/*) continue ;; esac
  IGNORE+="${IGNORE:+;}$(dirname "$f")"
done < <(find /usr /usr/local /opt -maxdepth 6 \( -iname 'protobuf-config.cmake' -o -iname 'ProtobufConfig.cmake' -o -iname 'abslConfig.cmake' -o -iname 'gRPCConfig.cmake' -o -iname 'glog-config.cmake' -o -iname 'gflags-config.cmake' \) -not -path "$BUNDLE/*" -not -path "$TORCH/*" 2>/dev/null)
{
  echo "date: $(date -u +%FT%TZ)"
  echo "uname: $(uname -a)"
  grep PRETTY_NAME /etc/os-release
  echo "gcc: $(g++ --version | head -1)"
  echo "cmake: $(cmake --version | head -1); ninja: $(ninja --version)"
  echo "nproc: $(nproc); jobs: $JOBS"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI, "cuda_available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
  echo "torch dir: $TORCH"
  echo "nvcc: ${NVCC:-none}"
  echo "nccl.h used: ${NCCL_INC:-<default include path>}"
  echo "system GTest config: ${GTEST_CONFIG:-none, using the bundled Debian googletest}"
  echo "ignored foreign CMake configs: ${IGNORE:-none}"
  ls -d "$SITE"/nvidia/*/ 2>/dev/null | sed 's/^/nvidia pkg: /'
  echo "--- nvidia-smi -L"
  nvidia-smi -L
  echo "--- bundle"
  cat "$BUNDLE/MANIFEST"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The bundle's programs (protoc, grpc_cpp_plugin, pkgconf) and libraries,
# for the build (protoc runs in it) and the tests. The loader sees links to
# the bundle's shared libraries minus libcurl (carried for CMake's FindCURL
# only; its dependencies are not in the bundle, and the machine's own
# programs may load theirs).
LDDIR=$BUILD-ld
rm -rf "$LDDIR"
mkdir -p "$LDDIR"
for f in "$L"/*.so.*; do
  case "$(basename "$f")" in libcurl.so*) continue ;; esac
  ln -s "$f" "$LDDIR/"
done
export PATH=$R/bin:$PATH
export LD_LIBRARY_PATH=$LDDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PKG_CONFIG_PATH=$L/pkgconfig
export PKG_CONFIG_LIBDIR=$L/pkgconfig
export CMAKE_POLICY_VERSION_MINIMUM=3.5

PREFIX_PATH=$R
[[ -z "$GTEST_CONFIG" ]] && PREFIX_PATH+=";$BUNDLE/gtest/usr"
CXX_FLAGS=""
# ProcessGroupNCCL.hpp's layout depends on nccl.h's version macros: use the
# nccl.h of the wheel's NCCL (what libtorch_cuda was built with), ahead of
# any /usr/include/nccl.h.
[[ -n "$NCCL_INC" ]] && CXX_FLAGS="-isystem $NCCL_INC"

COMMON=(
  -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
  -DLOCALSGD_BUILD_BENCH=OFF -DLOCALSGD_BUILD_TESTS=ON -DLOCALSGD_BUILD_TORCH=ON
  "-DCMAKE_PREFIX_PATH=$PREFIX_PATH"
  "-DCMAKE_IGNORE_PATH=$IGNORE"
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5
  "-DCMAKE_CXX_FLAGS=$CXX_FLAGS"
  # protobuf through CMake's FindProtobuf: the bundle's 3.21, not the
  # machine's /usr/include/google + libprotobuf.a.
  "-DProtobuf_INCLUDE_DIR=$R/include"
  "-DProtobuf_LIBRARY_RELEASE=$L/libprotobuf.so"
  "-DProtobuf_LIBRARY=$L/libprotobuf.so"
  "-DProtobuf_LITE_LIBRARY_RELEASE=$L/libprotobuf-lite.so"
  "-DProtobuf_PROTOC_LIBRARY_RELEASE=$L/libprotoc.so"
  "-DProtobuf_PROTOC_EXECUTABLE=$R/bin/protoc"
  "-DPKG_CONFIG_EXECUTABLE=$R/bin/pkgconf"
  # Only the security tests use the openssl CLI; they are not built here.
  "-DLOCALSGD_OPENSSL_CLI=$(command -v openssl || echo /bin/false)"
)

configure() {  # configure <torch mode: real|shim>
  rm -rf "$BUILD"
  mkdir -p "$BUILD"
  local extra=()
  if [[ $1 == real ]]; then
    extra+=("-DTorch_DIR=${NCCL_CHECK_TORCH_DIR:-$TORCH/share/cmake/Torch}")
    if [[ -n "$NVCC" ]]; then
      extra+=("-DCMAKE_CUDA_COMPILER=$NVCC" "-DCUDAToolkit_ROOT=$(dirname "$(dirname "$NVCC")")"
        -DCMAKE_CUDA_ARCHITECTURES=90)
    fi
  else
    mkdir -p "$BUILD/torch-shim/Torch"
    cp scripts/device/TorchConfig.shim.cmake "$BUILD/torch-shim/Torch/TorchConfig.cmake"
    ln -sfn "$TORCH/share/cmake/Caffe2" "$BUILD/torch-shim/Caffe2"
    extra+=("-DTorch_DIR=$BUILD/torch-shim/Torch" "-DLOCALSGD_SHIM_TORCH_ROOT=$TORCH")
  fi
  echo "=== configure ($1 TorchConfig) ==="
  echo "cmake -S . -B $BUILD ${COMMON[*]} ${extra[*]}"
  cmake -S . -B "$BUILD" "${COMMON[@]}" "${extra[@]}"
}

: >"$OUT/configure.log"
MODE=real
# The wheel's TorchConfig needs nvcc (see TorchConfig.shim.cmake).
[[ -z "$NVCC" && -z "${NCCL_CHECK_TORCH_DIR:-}" ]] && MODE=shim
if ! configure "$MODE" >>"$OUT/configure.log" 2>&1; then
  if [[ $MODE == real ]]; then
    echo "configure with the wheel's TorchConfig failed; retrying with the shim" | tee -a "$OUT/configure.log"
    MODE=shim
    configure shim >>"$OUT/configure.log" 2>&1 || fail configure "see configure.log" "$OUT/configure.log"
  else
    fail configure "see configure.log" "$OUT/configure.log"
  fi
fi
echo "configure: OK (TorchConfig: $MODE)"
grep -E 'localsgd: NCCL node-local path|TorchConfig shim|Found Protobuf|Found Torch' "$OUT/configure.log" | tail -n 20

# Which protobuf, gRPC, Abseil, glog configure picked: all must be the bundle's.
CACHE=$BUILD/CMakeCache.txt
{
  echo "--- packages picked (CMakeCache.txt)"
  grep -E '^(Protobuf_[A-Z_]*(LIBRARY|LIBRARY_RELEASE|INCLUDE_DIR|EXECUTABLE)|gRPC_DIR|absl_DIR|glog_DIR|gflags_DIR|prometheus-cpp_DIR|civetweb_DIR|GTest_DIR|Torch_DIR|Caffe2_DIR|ZLIB_INCLUDE_DIR|ZLIB_LIBRARY_RELEASE|OPENSSL_INCLUDE_DIR|CURL_INCLUDE_DIR|re2_DIR|c-ares_DIR|LOCALSGD_WITH_NCCL|CMAKE_CUDA_COMPILER)[:=]' "$CACHE"
} | tee -a "$OUT/configure.log"
bad=$(grep -E '^(Protobuf_(LIBRARY|LIBRARY_RELEASE|LITE_LIBRARY_RELEASE|INCLUDE_DIR|PROTOC_EXECUTABLE|PROTOC_LIBRARY_RELEASE)|gRPC_DIR|absl_DIR|glog_DIR|gflags_DIR|prometheus-cpp_DIR|civetweb_DIR|c-ares_INCLUDE_DIR|c-ares_LIBRARY|CURL_INCLUDE_DIR|ZLIB_INCLUDE_DIR|UNWIND_INCLUDE_DIR|UNWIND_LIBRARY)[:=]' "$CACHE" | grep -v "$BUNDLE" || true)
[[ -z "$bad" ]] || fail configure "not from the bundle: $bad" "$OUT/configure.log"
echo "protobuf: $(grep -E '^Protobuf_INCLUDE_DIR:' "$CACHE" | cut -d= -f2) ($("$R/bin/protoc" --version))"
if [[ -n "${NCCL_CHECK_CONFIGURE_ONLY:-}" ]]; then
  summary PASS "configure only: every dependency from the bundle (TorchConfig: $MODE)"
  exit 0
fi
grep -q '^LOCALSGD_WITH_NCCL:INTERNAL=ON' "$CACHE" ||
  fail configure "LOCALSGD_WITH_NCCL is not ON: LibTorch without USE_C10D_NCCL?" "$OUT/configure.log"

# --- build: what node_tests and the coordinator need ---
echo "=== build (-j$JOBS) ==="
if ! cmake --build "$BUILD" -j "$JOBS" --target node_tests localsgd-coordinator >"$OUT/build.log" 2>&1; then
  fail build "see build.log" "$OUT/build.log"
fi
echo "build: OK"
echo "--- ldd node_tests (libraries outside the bundle and torch)" >>"$OUT/build.log"
ldd "$BUILD/tests/node/node_tests" >>"$OUT/build.log" 2>&1
if ldd "$BUILD/tests/node/node_tests" | grep -q 'not found'; then
  fail build "node_tests has unresolved libraries" "$OUT/build.log"
fi

# --- tests ---
echo "=== nvidia-smi -L ==="
nvidia-smi -L
echo "=== node_tests ==="
export TORCH_NCCL_BLOCKING_WAIT=0 GLOG_logtostderr=1
timeout 420 "$BUILD/tests/node/node_tests" --gtest_output="xml:$OUT/node_tests.xml" \
  >"$OUT/node_tests.log" 2>&1
rc=$?
grep -E '^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|CUDA/NCCL case skipped' "$OUT/node_tests.log" | tail -n 60
(cd "$BUILD" && ctest -R node_nccl_configure --output-on-failure) >"$OUT/ctest.log" 2>&1
ctest_rc=$?
cuda_ok=$(grep -oE '^\[ +OK \] NodeGroupCudaTest\.[A-Za-z_]+' "$OUT/node_tests.log" | sort -u | wc -l)
skipped_names=$(grep -oE '^\[ +SKIPPED \] [A-Za-z][A-Za-z0-9_./]*' "$OUT/node_tests.log" |
  awk '{print $NF}' | sort -u)
skipped=$(printf '%s' "$skipped_names" | grep -c . || true)
passed=$(grep -oE '^\[ +PASSED +\] [0-9]+' "$OUT/node_tests.log" | grep -oE '[0-9]+$' || echo 0)
# Expected to skip on a machine with NCCL: the "cuda without NCCL" case.
# The Gloo cases (SKIP_WITHOUT_GLOO in the test) skip where the LibTorch
# ships no Gloo headers (pip wheels).
gloo_cases='NodeAveragingTest|Create_LeaderWeightNotGroupSize|Sync_CoordinatorGone_|Sync_LeaderGone_|MakeNodeGroup_TcpStore_FormsGlooGroup'
gloo_skipped=$(printf '%s' "$skipped_names" | grep -cE "$gloo_cases" || true)
skipped_other=$(printf '%s' "$skipped_names" |
  grep -v 'MakeNodeGroup_CudaWithoutNccl_FailedPrecondition' |
  grep -vE "$gloo_cases" | grep -c . || true)
if [[ $rc -eq 124 ]]; then
  fail tests "node_tests timed out (420 s)" "$OUT/node_tests.log"
elif [[ $rc -ne 0 ]]; then
  fail tests "node_tests exit $rc; $(grep -cE '^\[ +FAILED +\] [A-Za-z]' "$OUT/node_tests.log") failed" "$OUT/node_tests.log"
elif [[ $cuda_ok -lt 3 ]]; then
  fail tests "only $cuda_ok of 3 NodeGroupCudaTest cases ran OK ($skipped skipped)" "$OUT/node_tests.log"
elif [[ $skipped_other -ne 0 ]]; then
  fail tests "unexpected skips: $(echo $skipped_names)" "$OUT/node_tests.log"
elif [[ $ctest_rc -ne 0 ]]; then
  fail tests "node_nccl_configure failed" "$OUT/ctest.log"
fi
summary PASS "node_tests: $passed passed, $cuda_ok NCCL/CUDA cases ran OK, $skipped skipped (expected: CudaWithoutNccl, and $gloo_skipped Gloo cases without Gloo headers); TorchConfig: $MODE; torch $(python3 -c 'import torch; print(torch.__version__)')"
