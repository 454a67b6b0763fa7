#!/usr/bin/env bash
# Installs Debian's Docker engine (docker.io: dockerd 20.10, with its
# docker-init from tini) the way integration/tools/node-packages.sh
# installs the real node's containerd and runc: apt-get, only when missing,
# no recommends. It shares Debian's containerd and runc packages with the
# integration suite but never their daemons: hack/docker/start.sh gives
# dockerd its own containerd child, root, state and socket. A policy-rc.d
# that refuses service starts (as on these machines) keeps the package's
# init scripts from starting a system-wide dockerd; if there is none, the
# script stops one that the package started.
set -euo pipefail
if command -v dockerd >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "make e2e needs Debian's Docker engine; install it as root with apt-get install --no-install-recommends docker.io" >&2
  exit 1
fi
echo "installing docker.io with apt-get (first time only)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends docker.io >&2; then
  apt-get update >&2
  apt-get install -y --no-install-recommends docker.io >&2
fi
# Without a policy-rc.d the package's postinst starts the system dockerd
# (with iptables rules and docker0); the e2e suite never uses it.
if [ -S /var/run/docker.sock ] && [ -f /var/run/docker.pid ]; then
  echo "stopping the system dockerd the package started (the suite runs its own)" >&2
  (command -v service >/dev/null 2>&1 && service docker stop >&2) || kill "$(cat /var/run/docker.pid)" || true
fi
