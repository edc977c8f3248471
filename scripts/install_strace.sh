#!/usr/bin/env bash
# The test that kills the trainer in the middle of a background checkpoint write holds the
# write's fsync with strace (tests/training/test_checkpoint.py): Debian's strace. Idempotent:
# nothing happens when strace is there. Installing needs root and apt-get; without them that
# test skips and says why (under CI, RETRAIN_REQUIRE_EMULATED_NODES makes it fail instead).
set -euo pipefail
if command -v strace > /dev/null; then
  echo "strace: present"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
  echo "strace: missing; the mid-write kill test will skip (as root: apt-get install strace)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends strace > /dev/null \
  || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends strace > /dev/null; }
echo "strace: installed"
