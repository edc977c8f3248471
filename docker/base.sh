#!/usr/bin/env bash
# The local target's base image, as a tar of its root filesystem: Debian 12 (bookworm), the
# minimal variant debootstrap makes, with the same suites Debian's own image reads (updates and
# security). Public registries are out of reach here, so the cpu variant of docker/Dockerfile
# starts from this (BASE_IMAGE), where ACR starts from Debian's image. Writes the tar to $1.
set -euo pipefail
out=${1:?usage: base.sh OUT.tar}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --components=main bookworm "$work/rootfs" "$mirror" > "$work/log" 2>&1 \
  || { tail -20 "$work/log" >&2; echo "base.sh: debootstrap failed (log above)" >&2; exit 1; }
cat > "$work/rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
SOURCES
# What an image does not carry: package lists and downloads, logs, the build host's name.
rm -rf "$work/rootfs"/var/lib/apt/lists/* "$work/rootfs"/var/cache/apt/*.bin \
  "$work/rootfs"/var/cache/apt/archives/*.deb "$work/rootfs"/var/log/*.log \
  "$work/rootfs"/var/log/apt/* "$work/rootfs"/tmp/*
: > "$work/rootfs/etc/hostname"
tar --numeric-owner --sort=name -C "$work/rootfs" -cf "$out.partial" .
mv "$out.partial" "$out"
