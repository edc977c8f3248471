#!/usr/bin/env bash
# The test that kills the trainer in the middle of a background checkpoint write holds the
# write's fsync with strace (tests/training/test_checkpoint.py): Debian's strace. Idempotent:
# nothing happens when strace is there. Without root and apt-get that test skips and says why
# (under CI, RETRAIN_REQUIRE_EMULATED_NODES makes it fail instead).
set -euo pipefail
source "$(dirname "$0")/apt_programs.sh"
if command -v strace > /dev/null; then
  echo "strace: present"
  exit 0
fi
apt_programs strace "the mid-write kill test will skip" strace
