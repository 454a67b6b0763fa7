#!/usr/bin/env bash
# Installs what the integration suite's real node needs from Debian:
# containerd (with ctr), runc, the CNI plugins, iproute2, busybox-static
# (the node tests' base and pause images are made from it), and git (the
# git-source tests serve repositories with git http-backend and git
# upload-pack). Installs only
# what is missing, so on a ready machine it costs nothing. Without these
# the node tests fail; they do not skip.
set -euo pipefail
check() {
  missing=()
  command -v containerd >/dev/null 2>&1 && command -v ctr >/dev/null 2>&1 || missing+=(containerd)
  command -v runc >/dev/null 2>&1 || missing+=(runc)
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] || missing+=(containernetworking-plugins)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)
  [ -x /usr/lib/git-core/git-http-backend ] || missing+=(git)
}
check
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "the integration suite's real node needs these Debian packages; install them as root with apt-get install ${missing[*]}" >&2
  exit 1
fi
# One install at a time (make test starts one beside its unit stages, and
# its integration stage runs this again): the second waits for the first,
# then installs only what is still missing.
exec 8>"${TMPDIR:-/tmp}/buildq-node-packages.lock"
if command -v flock >/dev/null 2>&1 && ! flock -n 8; then
  echo "another node-packages.sh is installing; waiting for it" >&2
  flock 8
  check
  [ ${#missing[@]} -eq 0 ] && exit 0
fi
echo "installing ${missing[*]} with apt-get (first time only)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
  apt-get update >&2
  apt-get install -y --no-install-recommends "${missing[@]}" >&2
fi
