#!/usr/bin/env bash
# Builds the images of deploy/Dockerfile (localsgd/coordinator,
# localsgd/worker and localsgd/etcd) with podman, here, without a registry: the
# debian:bookworm-slim they start from is made locally from Debian's archive
# (mmdebstrap --variant=minbase bookworm, imported as
# docker.io/library/debian:bookworm-slim) and every build runs with
# --pull=never. The base tarball is cached in $IMAGE_CACHE and podman's layer
# cache is kept, so a second run with unchanged sources rebuilds nothing
# (`podman image prune` reclaims older sources' layers, and the build
# stages' cache with them). Prints each image's size and what podman's
# storage holds.
#
# The storage driver: overlay where the kernel mounts it on the storage's
# filesystem (each layer holds only its changes), else vfs (each layer a
# full copy of the tree: a build from scratch needs about 4x the disk and
# takes longer). Storage that already exists keeps its driver (podman
# refuses to open it with another).
#
# Usage: scripts/images.sh [coordinator] [worker] [etcd]   (default: all)
#        scripts/images.sh --driver   (print the driver it would use; exit)
# Environment: IMAGE_TAG (0.1.0), IMAGE_CACHE (/var/cache/localsgd-images),
#   PODMAN_STORAGE (overlay or vfs: no probing).
# Needs root, podman, runc and mmdebstrap (scripts/install-deps.sh installs
# them).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_TAG=${IMAGE_TAG:-0.1.0}
IMAGE_CACHE=${IMAGE_CACHE:-/var/cache/localsgd-images}
BASE=docker.io/library/debian:bookworm-slim
targets=("$@")
((${#targets[@]})) || targets=(coordinator worker etcd)

log() { echo "[images] $*"; }
die() { echo "[images] error: $*" >&2; exit 1; }

# rootful podman's default storage (containers-storage.conf's graphroot)
STORAGE_ROOT=/var/lib/containers/storage

storage_driver() {
  if [[ -n ${PODMAN_STORAGE:-} ]]; then echo "$PODMAN_STORAGE"; return; fi
  local d
  for d in overlay vfs; do
    if [[ -d $STORAGE_ROOT/$d-images ]]; then echo "$d"; return; fi
  done
  # Mount a one-file overlay where the layers would live: that is the test
  # that counts (the kernel module, the backing filesystem, the privileges).
  local probe_parent=$STORAGE_ROOT
  while [[ ! -d $probe_parent ]]; do probe_parent=$(dirname "$probe_parent"); done
  local probe
  probe=$(mktemp -d "$probe_parent/.localsgd-overlay-probe.XXXXXX" 2>/dev/null) \
    || { echo vfs; return; }
  mkdir "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
  echo x > "$probe/lower/f"
  local driver=vfs
  if mount -t overlay overlay \
      -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
      "$probe/merged" 2>/dev/null; then
    [[ $(cat "$probe/merged/f" 2>/dev/null) == x ]] && driver=overlay
    umount "$probe/merged"
  fi
  rm -rf "$probe"
  echo "$driver"
}

if [[ ${1:-} == --driver ]]; then storage_driver; exit 0; fi

for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || die "$tool is missing (scripts/install-deps.sh)"
done
DRIVER=$(storage_driver)
log "podman storage: $DRIVER driver in $STORAGE_ROOT"
# crun fails on this machine's hybrid cgroup setup; runc with cgroupfs works.
# The default ulimits are refused here: set them explicitly.
PODMAN=(podman --storage-driver "$DRIVER" --runtime runc
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
  case $target in coordinator|worker|etcd) ;; *) die "unknown image '$target' (coordinator, worker, etcd)";; esac
  start=$SECONDS
  log "building localsgd/$target:$IMAGE_TAG (deploy/Dockerfile --target $target)"
  "${PODMAN[@]}" build --pull=never --network host --layers \
    --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 \
    -f deploy/Dockerfile --target "$target" -t "localsgd/$target:$IMAGE_TAG" . \
    > >(sed -u 's/^/[images]   /') 2>&1
  size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "localsgd/$target:$IMAGE_TAG")
  log "localsgd/$target:$IMAGE_TAG: $((size / 1000000)) MB, built in $((SECONDS - start)) s"
done
log "podman storage now holds $(du -shx "$STORAGE_ROOT" 2>/dev/null | cut -f1)"
