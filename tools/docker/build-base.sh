#!/usr/bin/env bash
# Build the CI base image (default wcache-base:bookworm) from Debian packages alone, since no image
# registry is reachable: debootstrap a minimal bookworm with python3 (3.11) and pip, then
# `docker import` it. The root filesystem tarball is cached under $WCACHE_DOCKER_CACHE, so it is
# bootstrapped once per machine; an existing image is kept (FORCE=1 rebuilds). Needs root.
set -euo pipefail
TAG=${BASE_IMAGE:-wcache-base:bookworm}
CACHE=${WCACHE_DOCKER_CACHE:-/var/cache/wcache-docker}
PACKAGES=python3,python3-pip
TARBALL=$CACHE/bookworm-minbase-$(printf '%s' "$PACKAGES" | sha256sum | cut -c1-12).tar

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG: already built"
    exit 0
fi
mkdir -p "$CACHE"
if [ ! -s "$TARBALL" ]; then
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    cleanup() {
        for m in dev/pts dev/shm dev proc sys; do umount -l "$root/$m" 2>/dev/null || true; done
        rm -rf --one-file-system "$root"
    }
    trap cleanup EXIT
    echo "debootstrap --variant=minbase --include=$PACKAGES bookworm (about a minute)"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" >"$root.log" 2>&1 \
        || { tail -n 30 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
fi
docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$TARBALL" "$TAG"
echo "$TAG: imported from $TARBALL"
