#!/usr/bin/env bash
# The local target builds the training image (docker/Dockerfile, its cpu variant) and the
# emulated Batch nodes of the tests run their tasks in it: buildah builds it from a Debian base
# that debootstrap makes, docker-registry is the registry it is pushed to and pulled from.
# Idempotent: nothing happens when they are there. Installing needs root and apt-get; without
# them the build step says why and what to set instead (under CI, RETRAIN_REQUIRE_EMULATED_NODES
# makes the tests that need the image fail rather than skip).
set -euo pipefail
wanted=(buildah debootstrap docker-registry)
missing=()
for tool in "${wanted[@]}"; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "image tools: present (${wanted[*]})"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
  echo "image tools: missing ${missing[*]}; the image cannot be built here (as root: apt-get install ${missing[*]})"
  exit 0
fi
# The registry package ships a service; only its binary is wanted (see install_sshd.sh).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null \
  || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null; }
echo "image tools: installed ${missing[*]}"
