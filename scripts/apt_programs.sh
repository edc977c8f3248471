# Sourced by the install_*.sh scripts: installs Debian packages for their programs only.
# apt_programs WHAT WITHOUT PACKAGE...: as root with apt-get, installs the packages with the
# packages' own services kept from starting where an init system would start them (the
# project runs its own sshd, PostgreSQL and registry, on ports of its own); otherwise says
# what is missing and WITHOUT (what happens without them), and succeeds: `make setup` goes on.
apt_programs() {
  local what=$1 without=$2
  shift 2
  if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "$what: missing $*; $without (as root: apt-get install $*)"
    return 0
  fi
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "$@" > /dev/null \
    || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends "$@" > /dev/null; }
  echo "$what: installed $*"
}
