#!/usr/bin/env bash
# Builds the two images of deploy/Dockerfile (localsgd/coordinator and
# localsgd/worker) with podman, here, without a registry: the
# debian:bookworm-slim they start from is made locally from Debian's archive
# (mmdebstrap --variant=minbase bookworm, imported as
# docker.io/library/debian:bookworm-slim) and every build runs with
# --pull=never. The base tarball is cached in $IMAGE_CACHE and podman's layer
# cache is kept, so a second run with unchanged sources rebuilds nothing
# (it still takes a few minutes: the vfs driver copies every layer).
# Prints each image's size.
#
# Usage: scripts/images.sh [coordinator] [worker]   (default: both)
# Environment: IMAGE_TAG (0.1.0), IMAGE_CACHE (/var/cache/localsgd-images),
#   PODMAN_STORAGE (vfs; the storage driver that works on this machine).
# Needs root, podman, runc and mmdebstrap (scripts/install-deps.sh installs
# them).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_TAG=${IMAGE_TAG:-0.1.0}
IMAGE_CACHE=${IMAGE_CACHE:-/var/cache/localsgd-images}
BASE=docker.io/library/debian:bookworm-slim
targets=("$@")
((${#targets[@]})) || targets=(coordinator worker)

log() { echo "[images] $*"; }
die() { echo "[images] error: $*" >&2; exit 1; }

for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || die "$tool is missing (scripts/install-deps.sh)"
done
# crun fails on this machine's hybrid cgroup setup; runc with cgroupfs works.
# The default ulimits are refused here: set them explicitly.
PODMAN=(podman --storage-driver "${PODMAN_STORAGE:-vfs}" --runtime runc
        --cgroup-manager cgroupfs)
export PODMAN_ARGS="${PODMAN[*]:1}"

if ! "${PODMAN[@]}" image exists "$BASE"; then
  mkdir -p "$IMAGE_CACHE"
  if [[ ! -s $IMAGE_CACHE/bookworm-minbase.tar ]]; then
    log "making the base image from Debian's archive (mmdebstrap, about a minute)"
    mmdebstrap --quiet --variant=minbase --format=tar bookworm \
      "$IMAGE_CACHE/bookworm-minbase.tar.part"
    mv "$IMAGE_CACHE/bookworm-minbase.tar.part" "$IMAGE_CACHE/bookworm-minbase.tar"
  fi
  log "importing it as $BASE"
  "${PODMAN[@]}" import --quiet "$IMAGE_CACHE/bookworm-minbase.tar" "$BASE" >/dev/null
fi

for target in "${targets[@]}"; do
  case $target in coordinator|worker) ;; *) die "unknown image '$target' (coordinator, worker)";; esac
  start=$SECONDS
  log "building localsgd/$target:$IMAGE_TAG (deploy/Dockerfile --target $target)"
  "${PODMAN[@]}" build --pull=never --network host --layers \
    --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 \
    -f deploy/Dockerfile --target "$target" -t "localsgd/$target:$IMAGE_TAG" . \
    > >(sed -u 's/^/[images]   /') 2>&1
  size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "localsgd/$target:$IMAGE_TAG")
  log "localsgd/$target:$IMAGE_TAG: $((size / 1000000)) MB, built in $((SECONDS - start)) s"
done
