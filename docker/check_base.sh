#!/bin/sh
# The base image must bring no CUDA and hold no package: CUDA and NCCL come from torch's wheels
# (one CUDA per image), and apt never has to change a held package. A CUDA base image (whose
# devel flavour holds libnccl2 and libnccl-dev) fails here, before apt runs.
set -eu
fail() { echo "check_base: $*; BASE_IMAGE must be a plain OS image (see docker/Dockerfile)" >&2; exit 1; }
held=$(apt-mark showhold 2>/dev/null | tr '\n' ' ')
[ -z "$held" ] || fail "the base image holds packages: $held"
root=${CHECK_BASE_ROOT:-}  # another root to look in (the tests' stand-in for a base)
for dir in "$root"/usr/local/cuda "$root"/usr/local/cuda-*; do
  [ ! -e "$dir" ] || fail "the base image has a CUDA toolkit at ${dir#"$root"}"
done
found=$(ldconfig -p | grep -E 'lib(cudart|nccl)\.so' | tr '\n' ' ' || true)
[ -z "$found" ] || fail "the base image has CUDA or NCCL libraries: $found"
echo "check_base: no CUDA, no NCCL, no held package in the base ($VARIANT variant)"
