#!/usr/bin/env bash
# Installs the system packages the test suite needs when they are missing: redis-server (the SWA-pool tests
# start real servers on loopback ports) and libibverbs1 (libibverbs.so.1, which the mooncake package loads
# even over TCP; its tests start a real mooncake_master). On Debian/Ubuntu through apt-get, as root or through
# sudo; elsewhere it names what to install and fails. The first step of the README's test command; does
# nothing when all is there.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
[[ "$("$ldconfig" -p 2>/dev/null || true)" == *libibverbs.so.1* ]] || missing+=(libibverbs1)
[ "${#missing[@]}" -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "tests/system-deps.sh: the tests need ${missing[*]}; install it with your package manager" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "+ ${sudo:+$sudo }apt-get install -y ${missing[*]}" >&2
$sudo apt-get update
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
