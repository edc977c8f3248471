#!/usr/bin/env bash
# Debian packages of `make service` and its tests: PostgreSQL (the service's Prefect database;
# its binaries are used from /usr/lib/postgresql/<version>/bin, no cluster of the package's own
# is started), acl (setfacl: started as root, the service gives its unprivileged account access
# to the folders it needs, and no one else) and Chromium (the tests drive the Prefect UI in it,
# headless). Idempotent: nothing
# happens when both are there. Installing needs root and apt-get; without them the service says
# what is missing, and its tests skip saying why (under CI, RETRAIN_REQUIRE_EMULATED_NODES makes
# them fail instead).
set -euo pipefail
source "$(dirname "$0")/apt_programs.sh"
missing=()
compgen -G "/usr/lib/postgresql/*/bin/postgres" > /dev/null || missing+=(postgresql)
command -v setfacl > /dev/null || missing+=(acl)
command -v chromium > /dev/null || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
  echo "postgresql, acl, chromium: present"
  exit 0
fi
apt_programs "postgresql, acl, chromium" "make service needs postgresql (and acl as root)" "${missing[@]}"
