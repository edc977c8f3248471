#!/usr/bin/env bash
# Debian packages of `make service` and its tests: PostgreSQL (the service's Prefect database;
# its binaries are used from /usr/lib/postgresql/<version>/bin, no cluster of the package's own
# is started) and Chromium (the tests drive the Prefect UI in it, headless). Idempotent: nothing
# happens when both are there. Installing needs root and apt-get; without them the service says
# what is missing, and its tests skip saying why (under CI, RETRAIN_REQUIRE_EMULATED_NODES makes
# them fail instead).
set -euo pipefail
missing=()
compgen -G "/usr/lib/postgresql/*/bin/postgres" > /dev/null || missing+=(postgresql)
command -v chromium > /dev/null || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
  echo "postgresql, chromium: present"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
  echo "${missing[*]}: missing (as root: apt-get install ${missing[*]}); make service needs postgresql"
  exit 0
fi
# Only the programs are wanted: keep the packages' own services from starting where an init
# system would start them (make service runs its own PostgreSQL, in .service/).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null \
  || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null; }
echo "installed ${missing[*]}"
