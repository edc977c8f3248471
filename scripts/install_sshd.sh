#!/usr/bin/env bash
# The multi-node tests start an sshd on each emulated Batch node (tests/fakes/hosts.py), as the
# training image does on Batch: Debian's openssh-server. Idempotent: nothing happens when sshd is
# there. Without root and apt-get the multi-node tests skip and say why (under CI,
# RETRAIN_REQUIRE_EMULATED_NODES makes them fail instead).
set -euo pipefail
source "$(dirname "$0")/apt_programs.sh"
if [ -x /usr/sbin/sshd ]; then
  echo "sshd: present"
  exit 0
fi
apt_programs sshd "the multi-node tests will skip" openssh-server
