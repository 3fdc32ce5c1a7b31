#!/usr/bin/env bash
# Installs every Debian package localsgd needs to build, test and run its demo.
# Idempotent: packages already present are skipped; apt-get update runs only when
# something is missing. Run as root on Debian 12 (bookworm).
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev libgflags-dev prometheus-cpp-dev libcivetweb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libtorch-dev libgloo-dev
  zlib1g-dev dataset-fashion-mnist
  iproute2 procps python3
  # tests/deploy: a grpc.health.v1 client that is not ours, YAML for the
  # manifests. The manifest tests also need kubectl >= 1.27 (Debian 12's is
  # 1.20) and Node.js with npm (Debian's npm conflicts with NodeSource's
  # nodejs); they are not installed here, and those tests skip without them.
  python3-grpcio python3-protobuf python3-yaml
  # tests/fuzz: libFuzzer targets, built with clang (scripts/fuzz.sh).
  clang libclang-rt-14-dev
  # tests/security: certificates made at test time (openssl CLI); libcrypto
  # headers for token digests (server/auth.cc).
  openssl libssl-dev
  # tests/reference: the outer rules against torch.optim.SGD itself (the
  # same libtorch as libtorch-dev), and the accelerate peer of bench/.
  python3-torch
  # tests/deploy: the status page in a real browser (headless Chromium), the
  # Grafana dashboard's queries evaluated by a real Prometheus;
  # scripts/run-demo.sh: the loss/accuracy plot of a run.
  chromium prometheus python3-matplotlib
  # python/: the Python package (pybind11 over the C++ client) and its
  # tests (pytest, with python3-torch and numpy).
  pybind11-dev python3-dev python3-numpy python3-pytest
  # `pip install --no-build-isolation .` (pyproject.toml, setup.py) and its
  # test in tests/install: pip in a venv, with Debian's setuptools and wheel
  # as the build backend.
  python3-pip python3-venv python3-setuptools python3-wheel
  # scripts/images.sh and tests/deploy/images_test.py: the images of
  # deploy/Dockerfile built and run here, from a base made from Debian's
  # archive (no registry); catatonit is the pause process of the pods
  # `podman kube play` starts (the ha overlay's).
  podman runc mmdebstrap catatonit
  # ha/: the standby coordinator's election and fencing through etcd; the
  # etcd v3 gRPC protos (their gogoproto/google.api options are stripped at
  # build time) and a real etcd for the tests and scripts/ha-local.sh.
  etcd-server etcd-client golang-etcd-server-dev
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi
