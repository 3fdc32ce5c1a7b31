#!/usr/bin/env bash
# Recreates .device-bundle/ from scratch: the Debian 12 packages that a GPU
# machine without gRPC, Abseil, glog, gflags or prometheus-cpp needs to build
# localsgd's coordinator, client and node_tests against its own LibTorch
# (scripts/device/nccl_check.sh uses the bundle in place; nothing goes to /).
#
#   scripts/device/make_bundle.sh          # on Debian 12, as root or not
#
# What it does: `apt-get download` the packages below into
# .device-bundle/debs, `dpkg -x` them into .device-bundle/root, prune what a
# build does not need (static archives, docs, man pages, other plugins'
# data), make the CMake and pkg-config files relocatable (no absolute
# /usr/... paths), and check with ldd that every shared library and program
# in it finds its dependencies inside the bundle or among the libraries a
# stock Ubuntu 24.04 has. The .deb files are deleted at the end (the bundle
# travels to the device, the .debs need not); MANIFEST lists the versions.
#
# googletest goes into a separate prefix (.device-bundle/gtest): the check
# script uses it only where the device has no GTestConfig.cmake of its own.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
B=$REPO/.device-bundle
ROOT=$B/root

# Runtime and -dev packages. Kept to what configure and the node_tests link
# need; prometheus-cpp's config insists on its push library and on CURL.
PACKAGES=(
  # gRPC 1.51 (+ protoc plugin), protobuf 3.21, Abseil 20220623
  libgrpc++-dev libgrpc-dev libgrpc29 libgrpc++1.51 protobuf-compiler-grpc
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler
  libabsl-dev libabsl20220623
  libc-ares-dev libc-ares2 libre2-dev libre2-9
  # glog 0.6 and its dependencies (its config wants gflags and Unwind)
  libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2
  libunwind-dev libunwind8
  # prometheus-cpp 1.0 (server metrics) and civetweb; CURL for its config
  prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0
  libprometheus-cpp-push1.0 libcivetweb-dev libcivetweb1 civetweb
  libcurl4-openssl-dev libcurl4
  # zlib headers (gRPC's and prometheus' configs, examples/); the library
  # itself is the device's libz.so.1
  zlib1g-dev
  # pkg-config: gRPC's Findre2 needs it (Debian's re2 has no CMake config)
  pkgconf-bin libpkgconf3
)
GTEST_PACKAGES=(libgtest-dev)

rm -rf "$B"
mkdir -p "$B/debs" "$ROOT" "$B/gtest"
(cd "$B/debs" && apt-get download "${PACKAGES[@]}" "${GTEST_PACKAGES[@]}")
for deb in "$B"/debs/*.deb; do
  case "$(basename "$deb")" in
    libgtest-dev_*) dpkg -x "$deb" "$B/gtest" ;;
    *) dpkg -x "$deb" "$ROOT" ;;
  esac
done
{
  echo "# Debian 12 packages in this bundle (scripts/device/make_bundle.sh)"
  for deb in "$B"/debs/*.deb; do
    dpkg-deb -f "$deb" Package Version | paste -sd' '
  done
} >"$B/MANIFEST"
rm -rf "$B/debs"

LIB=$ROOT/usr/lib/x86_64-linux-gnu
# --- prune ---
rm -rf "$ROOT/usr/share/doc" "$ROOT/usr/share/man" "$ROOT/usr/share/lintian" \
  "$ROOT/usr/share/bug" "$ROOT/usr/share/aclocal" "$ROOT/usr/share/pkgconfig" \
  "$ROOT/usr/share/pkgconf" "$ROOT/usr/share/doc-base" "$ROOT/usr/share/protobuf"
# Static archives: everything links the shared libraries (gtest is
# separate), except those a CMake export file names (CMake checks that every
# imported target's file exists, e.g. gflags_static).
while IFS= read -r a; do
  if ! grep -rqF "/$(basename "$a")\"" "$ROOT/usr/lib/x86_64-linux-gnu/cmake"; then
    rm -f "$a"
  fi
done < <(find "$ROOT" -name '*.a')
# Other languages' gRPC plugins stay: gRPC's CMake config checks that they
# exist (a few hundred KB). curl's command line tools are not packaged here.
rm -rf "$B/gtest/usr/share/doc" "$B/gtest/usr/src"
# zlib: the device's libz.so.1 (zlib1g is essential on Ubuntu too).
rm -f "$LIB/libz.so"
ln -s /lib/x86_64-linux-gnu/libz.so.1 "$LIB/libz.so"

# --- relocate: no absolute /usr paths in CMake and pkg-config files ---
# glog-modules.cmake names its find-modules directory absolutely.
sed -i 's|set (glog_MODULE_PATH "/usr/share/glog/cmake")|get_filename_component (glog_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../../../share/glog/cmake" ABSOLUTE)|' \
  "$LIB/cmake/glog/glog-modules.cmake"
grep -q 'CMAKE_CURRENT_LIST_DIR' "$LIB/cmake/glog/glog-modules.cmake"
# pkg-config: prefix relative to the .pc file.
for pc in "$LIB"/pkgconfig/*.pc; do
  sed -i -e 's|^prefix=/usr$|prefix=${pcfiledir}/../../..|' \
    -e 's|^libdir=/usr/lib/x86_64-linux-gnu$|libdir=${prefix}/lib/x86_64-linux-gnu|' \
    -e 's|^includedir=/usr/include$|includedir=${prefix}/include|' \
    -e 's|^includedir=/usr/include/|includedir=${prefix}/include/|' "$pc"
  # Some (re2.pc) name libdir/includedir absolutely and define no prefix.
  grep -q '^prefix=' "$pc" || sed -i '1i prefix=${pcfiledir}/../../..' "$pc"
done
# Absolute symlinks inside the tree (e.g. libfoo.so -> /usr/lib/...) would
# point at the host: make them relative (the zlib one above is on purpose).
while IFS= read -r link; do
  target=$(readlink "$link")
  case "$target" in
    /lib/x86_64-linux-gnu/libz.so.1) continue ;;
    /*)
      if [[ -e "$ROOT$target" ]]; then
        ln -sfn "$(realpath --relative-to="$(dirname "$link")" "$ROOT$target")" "$link"
      else
        echo "make_bundle: dropping dangling absolute link $link -> $target" >&2
        rm -f "$link"
      fi
      ;;
  esac
done < <(find "$ROOT" -type l)

# What is left that names /usr absolutely (besides the _realOrig checks that
# CMake's export files carry, which only compare paths): must be nothing.
leftover=$(grep -rIl '/usr/' "$LIB/cmake" "$LIB/pkgconfig" "$ROOT/usr/share/glog" 2>/dev/null |
  xargs -r grep -nI '/usr/' | grep -v ':[0-9]*: *#' |
  grep -v '_realOrig\|_IMPORT_PREFIX "/usr/lib/x86_64-linux-gnu/cmake' || true)
if [[ -n "$leftover" ]]; then
  echo "make_bundle: absolute /usr paths left:" >&2
  echo "$leftover" >&2
  exit 1
fi

# --- ldd: every ELF file finds its libraries in the bundle or in what a
# stock Ubuntu 24.04 (with libssl3, zlib, liblzma) has ---
UBUNTU_BASE='^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|librt\.so\.1|libpthread\.so\.0|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libz\.so\.1|libssl\.so\.3|libcrypto\.so\.3|liblzma\.so\.5)$'
missing=0
while IFS= read -r f; do
  file -b "$f" | grep -q '^ELF' || continue
  while IFS= read -r dep; do
    name=${dep%% *}
    [[ -z "$name" || "$name" == statically ]] && continue
    if [[ "$name" =~ $UBUNTU_BASE ]]; then continue; fi
    if [[ -e "$LIB/$name" ]]; then continue; fi
    # libcurl.so.4 (prometheus push) is carried for CMake only: its own
    # dependencies are never loaded (nothing here links the push library).
    case "$(basename "$f")" in libcurl.so*|libprometheus-cpp-push.so*) continue ;; esac
    echo "make_bundle: $f needs $name, not in the bundle nor on stock Ubuntu 24.04" >&2
    missing=1
  done < <(ldd "$f" 2>/dev/null | awk '{print $1}')
done < <(find "$ROOT" -type f \( -name '*.so*' -o -path '*/bin/*' \))
[[ $missing -eq 0 ]] || exit 1

du -sh "$B"
