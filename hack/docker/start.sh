#!/usr/bin/env bash
# Starts an isolated dockerd for `make e2e` and prints the DOCKER_HOST to
# use (unix://<dir>/docker.sock) on stdout; everything else goes to stderr.
#
# Isolated means: its own --data-root (kept between runs, so images loaded
# once are reused), --exec-root, --pidfile, socket and config file; its own
# containerd child, which dockerd starts under its exec-root (never the
# integration suite's containerd); containers in a cgroup of their own
# (buildq-e2e); and no host networking changes at all: --iptables=false
# --ip6tables=false --ip-masq=false --ip-forward=false --bridge=none, so
# there is no docker0 and containers run with --network host. Logs go to
# <dir>/dockerd.log. Stop it with hack/docker/stop.sh.
#
# BUILDQ_DOCKER_DIR (default ~/.cache/buildq/docker) holds all of it;
# BUILDQ_DOCKER_STORAGE_DRIVER (default overlay2) picks the storage driver.
set -euo pipefail
dir=${BUILDQ_DOCKER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/docker}
driver=${BUILDQ_DOCKER_STORAGE_DRIVER:-overlay2}
sock=$dir/docker.sock
pidfile=$dir/dockerd.pid
log=$dir/dockerd.log
mkdir -p "$dir/data" "$dir/run"
export DOCKER_HOST=unix://$sock

if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  if docker info >/dev/null 2>&1; then
    echo "$DOCKER_HOST"
    exit 0
  fi
fi
command -v dockerd >/dev/null 2>&1 || { echo "no dockerd: run hack/docker/install.sh (apt-get install docker.io)" >&2; exit 1; }
# An empty config file: the host's /etc/docker/daemon.json, if any, is not ours.
[ -f "$dir/daemon.json" ] || echo '{}' >"$dir/daemon.json"
rm -f "$sock" "$pidfile"
: >"$log"
# setsid: dockerd and its containerd outlive this script, in their own
# session, until stop.sh ends them by the pid file.
setsid dockerd \
  --config-file "$dir/daemon.json" \
  --data-root "$dir/data" \
  --exec-root "$dir/run" \
  --pidfile "$pidfile" \
  -H "unix://$sock" \
  --storage-driver "$driver" \
  --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false --bridge=none \
  --userland-proxy=false \
  --exec-opt native.cgroupdriver=cgroupfs \
  --cgroup-parent buildq-e2e \
  --log-driver json-file \
  >>"$log" 2>&1 </dev/null &
for _ in $(seq 1 120); do
  if docker info >/dev/null 2>&1; then
    echo "dockerd $(docker version --format '{{.Server.Version}}') on $DOCKER_HOST (storage driver $driver, log $log)" >&2
    echo "$DOCKER_HOST"
    exit 0
  fi
  if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then break; fi
  if ! jobs -r %1 >/dev/null 2>&1 && ! [ -f "$pidfile" ]; then break; fi
  sleep 0.5
done
echo "dockerd did not come up on $DOCKER_HOST; the last lines of $log:" >&2
tail -n 30 "$log" >&2
bash "$(dirname "$0")/stop.sh" >&2 || true
exit 1
