#!/usr/bin/env bash
# The local target builds the training image (docker/Dockerfile, its cpu variant) and the
# emulated Batch nodes of the tests run their tasks in it: buildah builds it from a Debian base
# that debootstrap makes, docker-registry is the registry it is pushed to and pulled from.
# Idempotent: nothing happens when they are there. Installing needs root and apt-get; without
# them the build step says why and what to set instead (under CI, RETRAIN_REQUIRE_EMULATED_NODES
# makes the tests that need the image fail rather than skip).
set -euo pipefail
source "$(dirname "$0")/apt_programs.sh"
wanted=(buildah debootstrap docker-registry)
missing=()
for tool in "${wanted[@]}"; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "image tools: present (${wanted[*]})"
  exit 0
fi
apt_programs "image tools" "the image cannot be built here" "${missing[@]}"
