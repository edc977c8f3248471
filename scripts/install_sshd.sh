#!/usr/bin/env bash
# The multi-node tests start an sshd on each emulated Batch node (tests/fakes/hosts.py), as the
# training image does on Batch: Debian's openssh-server. Idempotent: nothing happens when sshd is
# there. Installing needs root and apt-get; without them the multi-node tests skip and say why
# (under CI, RETRAIN_REQUIRE_EMULATED_NODES makes them fail instead).
set -euo pipefail
if [ -x /usr/sbin/sshd ]; then
  echo "sshd: present"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
  echo "sshd: missing; the multi-node tests will skip (as root: apt-get install openssh-server)"
  exit 0
fi
# Only the binary is wanted: keep the package's own service from starting where an init system
# would start it (the tests run their own sshd on their own ports).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends openssh-server > /dev/null \
  || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends openssh-server > /dev/null; }
echo "sshd: installed openssh-server"
