#!/usr/bin/env bash
# Builds the runtime image shardserve:latest - coordinator, worker and CLI in one image - with no
# registry pull and no Docker engine: a Debian bookworm root file system made by debootstrap from
# the Debian archive, holding the runtime libraries the opt binaries link (found with readelf and
# dpkg -S here, so the list follows the code) and the binaries, imported into podman's store.
#   deploy/build_image.sh          (as root; installs podman, runc and debootstrap with apt)
# The root file system is cached under $SHARDSERVE_IMAGE_CACHE (~/.cache/shardserve-image), by its
# package list. Prints the image's size. deploy/run_image.sh runs a cluster from it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
for p in podman debootstrap runc catatonit; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends podman \
      debootstrap runc catatonit >&2
    break
  fi
done
bazel build --config=opt //server:coordinator_main //server:worker_main //client:shardserve >&2
bins=(.bazel/bin/server/coordinator_main .bazel/bin/server/worker_main .bazel/bin/client/shardserve)
# The packages of the libraries the binaries name (DT_NEEDED); debootstrap adds their dependencies.
packages=$(for b in "${bins[@]}"; do readelf -d "$b" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'; done |
  sort -u | while read -r lib; do
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
    [ -n "$path" ] && { dpkg -S "$path" 2>/dev/null || dpkg -S "$(realpath "$path")"; } | cut -d: -f1
  done | sort -u | grep -v -e '^libc6$' -e '^libgcc-s1$' | paste -sd, -)
echo "build_image: runtime packages: $packages" >&2
cache=${SHARDSERVE_IMAGE_CACHE:-$HOME/.cache/shardserve-image}
rootfs="$cache/rootfs-$(sha256sum <<<"$packages" | cut -c1-12)"
if [ ! -f "$rootfs.done" ]; then
  rm -rf "$rootfs"
  mkdir -p "$cache"
  debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" \
    http://deb.debian.org/debian >&2
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/*
  touch "$rootfs.done"
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/usr/local/bin"
cp -f "${bins[@]}" "$stage/usr/local/bin/"
tar -C "$rootfs" -cf "$stage/image.tar" .
tar -C "$stage" -rf "$stage/image.tar" ./usr/local/bin/coordinator_main \
  ./usr/local/bin/worker_main ./usr/local/bin/shardserve  # (the directory is in the root fs)
podman --storage-driver=vfs import \
  --change 'ENTRYPOINT ["/usr/local/bin/worker_main"]' \
  --change 'USER 65534:65534' \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'EXPOSE 50051' --change 'EXPOSE 50052' --change 'EXPOSE 9100' \
  --change "LABEL org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
  "$stage/image.tar" "${IMAGE:-shardserve:latest}" >&2
size=$(podman --storage-driver=vfs image inspect "${IMAGE:-shardserve:latest}" --format '{{.Size}}')
echo "build_image: ${IMAGE:-shardserve:latest} is $((size / 1048576)) MiB (root file system" \
  "$(du -sh "$rootfs" | cut -f1): Debian bookworm minbase, the runtime libraries and their" \
  "dependencies, the binaries)"
